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
    assert process_count("auto", limit) == cores
    limit.write_text("50000 100000\n")  # half a CPU: one process
    assert process_count("auto", limit) == 1
    limit.write_text(f"{cores * 4 * 100000} 100000\n")  # more CPU than cores: the cores
    assert process_count("auto", limit) == cores
    assert process_count("auto", tmp_path / "absent") == cores  # cgroup v1, or no cgroup
    assert process_count(3, limit) == 3


def test_processes_must_be_a_count_or_auto() -> None:
    assert Settings(workers="http://a:1", processes="auto").processes == "auto"
    assert Settings(workers="http://a:1", processes="4").processes == 4
    for wrong in ("0", "many"):
        with pytest.raises(ValueError, match="processes"):
            Settings(workers="http://a:1", processes=wrong)
