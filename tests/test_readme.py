"""The configuration table (docs/configuration.md) is the settings model's, the metrics table
(docs/metrics.md) the metric specs'."""

from __future__ import annotations

from pathlib import Path

from app.observe.metrics import METRICS, GatewayMetrics
from scripts import metrics_table
from scripts.settings_table import BEGIN, END, table


def test_the_configuration_table_matches_the_settings() -> None:
    root = Path(__file__).parent.parent
    doc = (root / "docs" / "configuration.md").read_text()
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    assert doc[start:end] == table(), (
        "run: python -m scripts.settings_table, paste in docs/configuration.md"
    )
    assert "docs/configuration.md" in (root / "README.md").read_text()


def test_the_metrics_table_matches_the_metric_specs() -> None:
    root = Path(__file__).parent.parent
    doc = (root / "docs" / "metrics.md").read_text()
    begin, end = metrics_table.BEGIN, metrics_table.END
    start, stop = doc.index(begin), doc.index(end) + len(end)
    assert doc[start:stop] == metrics_table.table(), (
        "run: python -m scripts.metrics_table, paste in docs/metrics.md"
    )


def test_the_metric_attributes_are_typed_as_their_specs_build_them() -> None:
    kinds = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram"}

    def typed(kind: str, labelled: bool) -> str:
        """A labelled metric is the module's Counter or Gauge alias or a BatchHistogram, one
        without labels prometheus_client's."""
        name = kinds.get(kind, "BatchHistogram")
        if not labelled and name != "BatchHistogram":
            return f"prometheus_client.{name}"
        return "BatchHistogram" if name == "Histogram" else name

    expected = {
        spec.attr: typed(spec.kind, bool(spec.labels)) + (" | None" if spec.only_with else "")
        for spec in METRICS
    }
    assert GatewayMetrics.__annotations__ == expected
