"""How many processes ``GATEWAY_PROCESSES`` asks for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.settings import Settings
from app.supervisor import process_count


def test_auto_is_one_per_core_within_the_containers_cpu_limit(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")  # no limit: every core this process may run on
    assert process_count("auto", limit, tmp_path) == cores
    limit.write_text("50000 100000\n")  # half a CPU: one process
    assert process_count("auto", limit) == 1
    limit.write_text(f"{cores * 4 * 100000} 100000\n")  # more CPU than cores: the cores
    assert process_count("auto", limit) == cores
    absent = tmp_path / "absent"
    assert process_count("auto", absent, absent) == cores  # no cgroup
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # cgroup v1, no limit
    assert process_count("auto", absent, v1) == cores
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")  # cgroup v1, half a CPU
    assert process_count("auto", absent, v1) == 1
    assert process_count(3, limit) == 3


def test_processes_must_be_a_count_or_auto() -> None:
    assert Settings(workers="http://a:1", processes="auto").processes == "auto"
    assert Settings(workers="http://a:1", processes="4").processes == 4
    for wrong in ("0", "many"):
        with pytest.raises(ValueError, match="processes"):
            Settings(workers="http://a:1", processes=wrong)
