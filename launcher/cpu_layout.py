"""Which cores each of ``epd serve``'s model workers runs on (``--cpu-bind``, ``EPD_CPU_BIND``).

``auto`` (the default; CPU device only): the cores serve may use are handed out in order to the
decode workers, then the encoders, then the prefill workers, each taking as many cores as it runs
torch threads (``OMP_NUM_THREADS``), while that many are left. A worker for which too few are left
is not bound (the kernel runs it wherever a core is free), nor is the gateway, whose event loop
must run wherever one is; nor is a worker whose share would be every core anyway. A bound
worker's threads stay on its own cores: its caches are still warm when the next request wakes it,
and no other model worker's bursts land there. Two processes that run one after the other for
every request (the encoder, then the decode worker's prompt step) no longer chase each other
across the same two cores (bench/RESULTS.md, "Workers on cores of their own").

So on two cores the demo model (one thread a worker: its weights are under
``SMALL_MODEL_BYTES``) gets decode on core 0 and the encoder on core 1, prefill and the gateway
unbound; the bench model's decode worker runs two threads, takes both cores, and nothing is bound
(an OpenMP team whose cores a bound neighbour shares waits for it at every barrier).

``reserve`` (CPU device only; vLLM's CPU backend's layout): each decode worker's model thread and
its OpenMP team run on cores of their own (``EPD_MODEL_CORES``), every core but the last split
evenly among the decode workers; everything else runs on the cores left (at least one): each
decode worker's event loop and gRPC threads, the encoders and the prefill workers (one thread
each per core left); the gateway is not bound. On two cores a two-thread decode team under
``auto`` computes at one thread's speed in the server (every other thread of the stack lands on
one of its cores and the team waits for it at each barrier), so one decode thread alone on its
core steps as fast, without the gaps, and conditional placement sends a prompt that would stall
busy decoders to the prefill worker on the other core (its cores are apart from the decode
step's: ``runtime/policy/placement_policy.py``; bench/RESULTS.md, "One core for the decode step").
Long prompts then queue for that one core: the layout suits short chats.

``none``, or ``--device cuda``: nothing is bound (on a GPU host a worker's CPU work is its event
loop, gRPC and kernel launches, which want whichever core is free).

A child binds itself first thing (``EPD_CPU_CORES``, read by ``launcher.cli`` before anything can
start a thread), so every thread it ever starts inherits the binding; a restart keeps it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from runtime.worker.host_cpu import MODEL_CORES_ENV, model_cores

CORES_ENV = "EPD_CPU_CORES"


def plan_cores(threads: Sequence[int], cpus: Sequence[int]) -> list[list[int] | None]:
    """Per worker (in hand-out order, each running ``threads[i]`` torch threads) the cores it is
    bound to, or ``None``: unbound."""
    free = sorted(cpus)
    out: list[list[int] | None] = []
    for n in threads:
        if n >= len(cpus):       # every core: bound to all is no binding, and none is left to bind anyone else to
            out.append(None)
            free = []
        elif 0 < n <= len(free):
            out.append(free[:n])
            free = free[n:]
        else:
            out.append(None)
    return out


def plan_reserved(decodes: int, cpus: Sequence[int]) -> tuple[list[list[int]], list[int]] | None:
    """``--cpu-bind reserve``: each decode worker's model cores, and the cores left for everything
    else; ``None`` when there are not more cores than decode workers."""
    cpus = sorted(cpus)
    if decodes < 1 or len(cpus) <= decodes:
        return None
    each = (len(cpus) - 1) // decodes
    return [cpus[i * each:(i + 1) * each] for i in range(decodes)], cpus[decodes * each:]


def checkpoint_weight_bytes(model: str) -> int | None:
    """The size of a local checkpoint's weight files (``*.safetensors``, else ``*.bin``); ``None``
    for a hub id or a folder without them."""
    path = Path(model)
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
    return sum(f.stat().st_size for f in files) if files else None


def format_cores(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


def parse_cores(text: str) -> set[int]:
    """``"0,3"`` -> ``{0, 3}``; ``ValueError`` for anything else."""
    cores = {int(part) for part in text.split(",")}
    if not cores or min(cores) < 0:
        raise ValueError(f"not a list of core numbers: {text!r}")
    return cores


def bind_from_env(environ=os.environ) -> set[int] | None:
    """Bind this process to ``EPD_CPU_CORES`` (comma-separated core numbers), if set; the cores bound.
    Call it before anything starts a thread: threads started later inherit the binding. First
    checks ``EPD_MODEL_CORES`` (the model thread's own, bound when that thread starts) against the
    cores this process was started with."""
    try:   # checked here, against the cores this process may use, so the model thread's own binding cannot fail
        model = model_cores(environ)
        allowed = os.sched_getaffinity(0)
        if model and not model <= allowed:
            raise ValueError(f"names cores outside {format_cores(sorted(allowed))}")
    except ValueError as exc:
        raise SystemExit(f"epd: {MODEL_CORES_ENV}={environ.get(MODEL_CORES_ENV)!r}: {exc}") from None
    text = environ.get(CORES_ENV, "").strip()
    if not text:
        return None
    try:
        cores = parse_cores(text)
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"epd: cannot bind to {CORES_ENV}={text!r}: {exc}") from None
    return cores
