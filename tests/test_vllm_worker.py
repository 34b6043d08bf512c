"""The worker launcher's choices by CPU: a dtype per runner, and cores (``scripts/vllm_worker``)."""

from __future__ import annotations

import socket

import pytest

from scripts.vllm_worker import (
    TINY_LLAMA_HARDWARE,
    VllmWorker,
    cpu_dtype,
    ephemeral_range,
    free_port,
    hardware_for,
    main,
    separate_cpus,
)

AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma avx avx2 f16c bmi2
"""
SKYLAKE_X = AVX2_ONLY.replace("avx2 ", "avx2 avx512f avx512bw ")
AVX512_BF16 = AVX2_ONLY.replace("avx2 ", "avx2 avx512f avx512bw avx512_bf16 ")
SAPPHIRE_RAPIDS = AVX2_ONLY.replace(
    "avx2 ", "avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8 "
)
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics\n"


@pytest.mark.parametrize(
    ("cpuinfo", "generate", "pooling"),
    [
        (AVX2_ONLY, "float32", "float32"),
        (SKYLAKE_X, "bfloat16", "float32"),
        (AVX512_BF16, "bfloat16", "float32"),
        (SAPPHIRE_RAPIDS, "bfloat16", "float32"),
        (GRAVITON3, "bfloat16", "float32"),
        (NEOVERSE_N1, "float32", "float32"),
        ("", "bfloat16", "float32"),
    ],
    ids=["avx2-only", "avx512", "avx512-bf16", "amx", "arm-bf16", "arm-no-bf16", "unreadable"],
)
def test_bf16_only_where_the_cpu_computes_it_and_the_runner_survives_it(
    cpuinfo: str, generate: str, pooling: str
) -> None:
    assert cpu_dtype(cpuinfo, runner="generate") == generate
    assert cpu_dtype(cpuinfo) == generate
    assert cpu_dtype(cpuinfo, runner="pooling") == pooling


def test_the_worker_is_started_with_its_runner_and_dtype() -> None:
    command = VllmWorker(8999, dtype="float32").command()
    assert command[command.index("--dtype") + 1] == "float32"
    assert "--runner" not in command
    default = VllmWorker(8999).command()
    assert default[default.index("--dtype") + 1] == cpu_dtype()
    pooling = VllmWorker(8999, runner="pooling").command()
    assert pooling[pooling.index("--dtype") + 1] == "float32"
    assert pooling[pooling.index("--runner") + 1] == "pooling"
    assert pooling[pooling.index("--convert") + 1] == "embed"


def test_the_command_line_passes_runner_and_dtype_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[VllmWorker] = []

    def start(worker: VllmWorker) -> None:
        seen.append(worker)
        raise KeyboardInterrupt  # stands for Ctrl-C right after the start

    monkeypatch.setattr(VllmWorker, "start", start)
    # main() takes SIGINT and SIGTERM over, and ignores both on its way out: not this process's.
    monkeypatch.setattr("signal.signal", lambda signum, handler: None)
    assert main(["--port", "8999", "--runner", "pooling"]) == 0
    assert main(["--port", "8999", "--dtype", "bfloat16", "--enforce-eager"]) == 0
    assert [(w.runner, w.dtype) for w in seen] == [
        ("pooling", "float32"),
        ("generate", "bfloat16"),
    ]
    assert seen[1].command()[-1] == "--enforce-eager"


def test_the_roofline_figures_follow_the_dtype() -> None:
    assert hardware_for("bfloat16") == TINY_LLAMA_HARDWARE
    wide = hardware_for("float32")
    assert wide["dtype_bytes"] == 4.0
    assert wide["kv_bytes_per_token"] == 2 * TINY_LLAMA_HARDWARE["kv_bytes_per_token"]
    assert wide["peak_tflops"] == TINY_LLAMA_HARDWARE["peak_tflops"]


@pytest.mark.parametrize(
    ("cpus", "most", "expected"),
    [
        ({0}, 2, [None]),
        ({0, 1}, 2, ["0"]),
        ({0, 1, 2}, 2, ["0", "1"]),
        ({0, 1, 2, 3, 4}, 2, ["0,1", "2,3"]),
        ({2, 3, 5, 7}, 2, ["2", "3"]),
        ({0, 1, 2, 3, 4}, 1, ["0,1,2,3"]),
    ],
)
def test_workers_get_cores_of_their_own_leaving_the_last_one(
    monkeypatch: pytest.MonkeyPatch, cpus: set[int], most: int, expected: list[str | None]
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cpus)
    assert separate_cpus(most) == expected


def test_free_ports_come_from_below_the_ephemeral_range_each_once() -> None:
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port < low for port in ports)
    for port in ports[:5]:  # free: a server can bind each
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert ephemeral_range("1024\t65000\n") == (1024, 65000)
    assert ephemeral_range("garbage") == (32768, 60999)
