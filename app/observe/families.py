"""Labelled counters and gauges whose children are plain numbers: no lock, no check per call.

prometheus_client's metrics take a lock on every ``inc`` and ``set`` and check each call's
labels; a relayed request makes about twenty such calls. The gateway runs each process on one
event loop, so its children need neither. These families are prometheus_client
:class:`~prometheus_client.registry.Collector`\\ s (its documented custom-collector API) and expose
the same text as its ``Counter`` and ``Gauge`` (a counter's ``_total`` and ``_created``, a
gauge's value), which ``tests/test_metric_families.py`` compares.

In prometheus_client's multiprocess mode the samples must go to its files, which only its own
metrics write: :meth:`app.observe.metrics.MetricSpec.build` builds those there instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class CounterChild:
    """One label set of a :class:`CounterFamily`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()  # a wall-clock timestamp, as Prometheus' _created is

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (not negative: a counter only goes up)."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount

    def samples(self) -> tuple[tuple[str, float], ...]:
        """``(suffix of the metric's name, value)`` of each of its series."""
        return ("_total", self.value), ("_created", self.created)


class GaugeChild:
    """One label set of a :class:`GaugeFamily`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount``."""
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        """Take ``amount`` away."""
        self.value -= amount

    def set(self, value: float) -> None:
        """Set the value."""
        self.value = float(value)

    def samples(self) -> tuple[tuple[str, float], ...]:
        """``(suffix of the metric's name, value)`` of its one series."""
        return (("", self.value),)


C = TypeVar("C", CounterChild, GaugeChild)


class _Family(Collector, Generic[C]):
    """A labelled metric of ``kind``: its children by label values, made at zero on first use."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry,
        kind: str, make: Callable[[], C],
    ) -> None:  # fmt: skip
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._kind = kind
        self._make: Callable[[], C] = make
        self._children: dict[tuple[str, ...], C] = {}
        self._labels: dict[tuple[str, ...], dict[str, str]] = {}
        registry.register(self)

    def labels(self, *values: str) -> C:
        """The child for these label values (made at zero on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}")
            # As prometheus_client does: each value as its str (an enum's, say).
            self._labels[values] = dict(zip(self._labelnames, map(str, values), strict=True))
            child = self._children[values] = self._make()
        return child

    def remove(self, *values: str) -> None:
        """Drop a child's series; a KeyError if it has none, as prometheus_client raises."""
        del self._children[values]
        del self._labels[values]

    def describe(self) -> list[Metric]:
        """The metric without samples (so registering does not collect)."""
        return [Metric(self._name, self._documentation, self._kind)]

    def collect(self) -> Iterator[Metric]:
        """The samples, child by child, as prometheus_client's own metric of the kind."""
        metric = Metric(self._name, self._documentation, self._kind)
        for values, child in list(self._children.items()):
            labels = self._labels[values]
            for suffix, value in child.samples():
                metric.add_sample(self._name + suffix, labels, value)
        yield metric


class CounterFamily(_Family[CounterChild]):
    """A labelled counter: ``<name>_total`` and ``<name>_created`` per label set."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name, documentation, labelnames, registry, "counter", CounterChild)


class GaugeFamily(_Family[GaugeChild]):
    """A labelled gauge: ``<name>`` per label set."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name, documentation, labelnames, registry, "gauge", GaugeChild)
