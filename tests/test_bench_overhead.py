"""The overhead benchmark's many-streams run fits the gateway's descriptors, probes included."""

from __future__ import annotations

import resource

from app.fleet.upstream import descriptors_fit
from bench.overhead import MEMORY_PROBE_ROOM, nofile_for, streams_that_fit


def test_the_relays_budget_is_cut_to_two_descriptors_a_stream_with_some_kept() -> None:
    assert min(100, descriptors_fit(10_000)) == 100
    cut = descriptors_fit(20_000)
    assert 9_000 < cut < 10_000
    assert 2 * cut < 20_000  # every stream's two, and some for everything else


def test_the_memory_run_asks_no_more_streams_than_the_gateway_can_hold_beside_its_probes() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert nofile_for(1) == soft
    for asked in (100, 10_000, 50_000):
        streams, nofile = streams_that_fit(asked)
        assert nofile >= soft
        assert hard == resource.RLIM_INFINITY or nofile <= max(hard, 2 * asked + 1024)
        assert 0 < streams <= asked
        budget = min(asked + MEMORY_PROBE_ROOM, descriptors_fit(nofile))
        assert streams + MEMORY_PROBE_ROOM <= budget
        if streams < asked:  # cut only where the descriptors did not fit them all
            assert budget < asked + MEMORY_PROBE_ROOM
