"""The admission benchmark's reading of the gateway's metrics."""

from __future__ import annotations

from bench.admission import limit_cuts, parse_sample

_PAGE = """\
# TYPE gateway_worker_limit_cuts_total counter
gateway_worker_limit_cuts_total{worker="a:1",cause="ttft_miss"} 2.0
gateway_worker_limit_cuts_total{worker="a:1",cause="decode_line"} 0.0
gateway_worker_limit_cuts_total{worker="b:1",cause="ttft_miss"} 1.0
# TYPE gateway_worker_concurrency_limit gauge
gateway_worker_concurrency_limit{worker="a:1"} 12.0
"""


def test_limit_cuts_are_sampled_per_worker_and_cause_and_summed_over_a_run() -> None:
    first = parse_sample(_PAGE)
    assert first["gateway_worker_limit_cuts_total{a:1,ttft_miss}"] == 2
    assert first["gateway_worker_concurrency_limit{a:1}"] == 12
    last = parse_sample(
        _PAGE.replace('cause="ttft_miss"} 2.0', 'cause="ttft_miss"} 5.0').replace(
            'cause="decode_line"} 0.0', 'cause="decode_line"} 4.0'
        )
    )
    # Only what happened between the run's first and last sample, over all workers.
    assert limit_cuts([first, {"t": 1.0}, last]) == {"ttft_miss": 3, "decode_line": 4}
    assert limit_cuts([first, first]) == {}
    assert limit_cuts([]) == {}
