"""The servers a benchmark starts, as ``launcher.processes`` processes (not yet started).

Every one runs from the repository root with this process's environment plus its own
variables, logs to a file under the run's log folder, and gets the parent-death signal, so
a killed benchmark leaves none behind. ``wait_http`` / ``wait_grpc`` wait until one serves and
fail early, with the log's tail, when a process exits (``StartError``).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.processes import (
    Process,
    ProcessSpec,
    StartError,
    child_env,
    free_port,
    grpc_serving,
    http_ok,
    wait_serving,
)

from .paths import RESULTS, ROOT

EPD = [sys.executable, "-m", "launcher.cli"]

__all__ = ["EPD", "RESULTS", "ROOT", "Process", "StartError", "bench_process", "epd_serve", "free_port",
           "transformers_serve", "venv_tool", "wait_grpc", "wait_http", "worker_cmd"]


def bench_process(name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                  stop_timeout_s: float = 20.0, root: Path = ROOT) -> Process:
    """A benchmark's child: cwd ``root`` (the repository root, or another checkout of it, whose code
    ``python -m`` then runs), this process's environment plus ``env``."""
    return Process(ProcessSpec(name, list(argv), child_env(env), log_path, root, stop_timeout_s))


def venv_tool(name: str) -> str:
    """A console script next to this interpreter (``.venv/bin/transformers``)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def transformers_serve(model: Path, port: int, logs: Path, threads: int | None = None) -> Process:
    """``transformers serve MODEL`` on loopback, offline, on the CPU; ``threads`` its OMP_NUM_THREADS
    (None / 0: torch's default, all cores, set explicitly against an inherited value)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads) if threads else str(os.cpu_count() or 1)}
    cmd = [venv_tool("transformers"), "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--log-level", "warning", str(model.resolve())]
    return bench_process("transformers serve", cmd, logs / f"transformers-serve-{port}.log", env)


def epd_serve(model: Path, port: int, logs: Path, name: str, extra: Sequence[str] = (),
              env: Mapping[str, str] | None = None, root: Path = ROOT) -> Process:
    """``epd serve --model MODEL`` with the gateway on ``port``, served as ``name``, run from ``root``'s code."""
    cmd = [*EPD, "serve", "--model", str(model.resolve()), "--port", str(port), "--served-model-name", name, *extra]
    return bench_process("epd serve", cmd, logs / f"epd-serve-{port}.log", env, root=root)


def worker_cmd(role: str, model: Path, port: int, cores: str | None, extra: Sequence[str] = ()) -> list[str]:
    """``epd <role>`` on loopback ``port``; under ``taskset -c cores`` when ``cores`` is given."""
    pin = ["taskset", "-c", cores] if cores else []
    return [*pin, *EPD, role, "--model", str(model.resolve()), "--host", "127.0.0.1", "--port", str(port), *extra]


def wait_http(url: str, procs: Sequence[Process], timeout_s: float = 300.0) -> None:
    """Until ``url`` answers 200."""
    wait_serving(functools.partial(http_ok, url), procs, timeout_s, url)


def wait_grpc(address: str, procs: Sequence[Process], timeout_s: float = 300.0) -> None:
    """Until the worker at ``address`` reports SERVING."""
    wait_serving(functools.partial(grpc_serving, address), procs, timeout_s, address)
