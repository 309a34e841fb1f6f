"""``epd serve``: the whole stack on one machine, as separate processes talking gRPC.

Starts encoder, prefill and decode workers (each ``epd <role>`` in its own process, exactly as
in a deployment) on loopback, and, once every worker reports SERVING on the gRPC health
service, the gateway on ``--host`` (``EPD_HOST``). Then it supervises them
(``launcher.supervisor``): a child that exits is restarted on the same address with backoff,
and given up on, loudly, after repeated exits in a short window. Ctrl-C or SIGTERM stops the
gateway first, then drains the workers.

Every default comes from the settings classes of the processes it configures
(``WorkerSettings``, ``GatewaySettings``, ``ServeSettings``), so an ``EPD_*`` variable means the
same to serve as to them, and serve passes a flag to a child only for what it decides itself
(model, device, listening address, and ``--limit-images-per-request``, which every process
must agree on; ``--no-prefix-cache`` goes to the decode workers). Besides serve's own environment every child gets:

- ``EPD_ENCODER_ADDRS``, ``EPD_PREFILL_ADDRS``, ``EPD_DECODE_ADDRS``: every worker's address,
  all fixed before the first one starts (a role without workers: the variable is unset);
- ``EPD_INTERNAL_TOKEN``: the one set, else one generated for this run (never printed);
- the gateway alone: ``EPD_API_KEY``, the ``--api-key`` values comma-separated;
- ``OMP_NUM_THREADS``, unless serve's environment sets it: on the CPU each decode worker gets
  ``cpus // decodes`` threads and every other process ``cpus // model workers`` (at least 1; on
  CUDA 1). The decode worker runs the step every streamed token waits for, and colocated
  prompts too, while the prefill worker idles at low load and the encoder runs in bursts, so
  it gets the cores (``worker_threads``). A checkpoint whose weight files are under
  ``SMALL_MODEL_BYTES`` runs every process on one thread (the worker's own fit would anyway);
- ``EPD_CPU_CORES``, a model worker's own cores (``--cpu-bind auto``, the default, on the CPU:
  ``launcher/cpu_layout.py``), unless serve's environment sets it; with ``--cpu-bind reserve``
  also ``EPD_MODEL_CORES``, each decode worker's model thread's cores, and ``OMP_NUM_THREADS`` to
  match (unless serve's environment sets it).
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import socket
import sys

from pydantic import ValidationError

from gateway.settings import GatewaySettings
from runtime.worker.settings import WorkerSettings

from .cpu_layout import CORES_ENV, MODEL_CORES_ENV, checkpoint_weight_bytes, format_cores, plan_cores, plan_reserved
from .processes import accepting, free_port, grpc_serving
from .restart_policy import RestartPolicy
from .serve_settings import ServeSettings
from .supervisor import Child, ChildSpec, Supervisor, install_stop_signals

WORKER_HOST = "127.0.0.1"        # workers are reached by the local gateway only
ROLES = ("encoder", "prefill", "decode")
BIND_ORDER = ("decode", "encoder", "prefill")   # who gets cores of its own first (--cpu-bind auto)
EXE = [sys.executable, "-m", "launcher.cli"]
STOP_GRACE_S = 5.0               # beyond a child's own drain timeout before it is killed


def _cannot_listen(host: str, port: int) -> str | None:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
            s.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _load_settings() -> tuple[WorkerSettings, GatewaySettings, ServeSettings]:
    try:
        return WorkerSettings(), GatewaySettings(), ServeSettings()
    except ValidationError as exc:
        print(f"epd serve: invalid EPD_* setting:\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_args(argv: list[str], worker: WorkerSettings, gateway: GatewaySettings,
               serve: ServeSettings) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epd serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=worker.model, help="model folder or hub id (EPD_MODEL)")
    p.add_argument("--served-model-name", default=gateway.served_model_name, help="(EPD_SERVED_MODEL_NAME)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=worker.device, help="(EPD_DEVICE)")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--host", default=gateway.host, help="the gateway's listening address (EPD_HOST); workers use loopback")
    p.add_argument("--port", type=int, default=gateway.port, help="the gateway's port (EPD_PORT)")
    p.add_argument("--redis-url", default=worker.redis_url,
                   help="shared encoder cache + discovery; embedded cache when absent (EPD_REDIS_URL)")
    p.add_argument("--placement", choices=["conditional", "colocated", "disaggregated"], default=gateway.placement,
                   help="(EPD_PLACEMENT)")
    p.add_argument("--limit-images-per-request", type=int, default=gateway.limit_images_per_request,
                   help="images one request may carry; more is a 400 before any work (EPD_LIMIT_IMAGES_PER_REQUEST)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=worker.prefix_cache,
                   help="decode workers keep no KV after a request ends (EPD_PREFIX_CACHE=false)")
    p.add_argument("--no-sliding-window-kv", dest="sliding_window_kv", action="store_false", default=worker.sliding_window_kv,
                   help="prefill and decode keep every position of a sliding-window layer (EPD_SLIDING_WINDOW_KV=false)")
    p.add_argument("--api-key", action="append", default=None,
                   help="an API key the gateway requires (repeatable; EPD_API_KEY, comma-separated)")
    p.add_argument("--log-format", choices=["text", "json"], default=gateway.log_format,
                   help="every process's log lines as text or one JSON object each (EPD_LOG_FORMAT)")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=gateway.otlp_traces_endpoint,
                   help="every process exports OpenTelemetry traces over OTLP/HTTP to URL (EPD_OTLP_TRACES_ENDPOINT)")
    p.add_argument("--restart-backoff-s", type=float, default=serve.restart_backoff_s,
                   help="first restart delay of a crashed child, doubling per further crash (EPD_RESTART_BACKOFF_S)")
    p.add_argument("--restart-max-backoff-s", type=float, default=serve.restart_max_backoff_s,
                   help="(EPD_RESTART_MAX_BACKOFF_S)")
    p.add_argument("--restart-limit", type=int, default=serve.restart_limit,
                   help="give up on a child after this many crashes within the window (EPD_RESTART_LIMIT)")
    p.add_argument("--restart-window-s", type=float, default=serve.restart_window_s, help="(EPD_RESTART_WINDOW_S)")
    p.add_argument("--cpu-bind", choices=["auto", "reserve", "none"], default=serve.cpu_bind,
                   help="auto: each model worker on the CPU device runs on cores of its own while enough are "
                        "left; reserve: each decode worker's model thread on cores of its own, everything else "
                        "on the last core; none: the kernel places every process (EPD_CPU_BIND)")
    args = p.parse_args(argv)
    if (args.cpu_bind == "reserve" and args.device == "cpu" and hasattr(os, "sched_getaffinity")
            and plan_reserved(args.decodes, sorted(os.sched_getaffinity(0))) is None):
        p.error(f"--cpu-bind reserve needs more cores than decode workers: {len(os.sched_getaffinity(0))} "
                f"core(s) for {args.decodes}")
    for name in ("encoders", "decodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.prefills < 0:
        p.error("--prefills must be >= 0")
    if args.placement == "disaggregated" and args.prefills == 0:
        p.error("--placement disaggregated needs --prefills >= 1")
    if not 0 <= args.port <= 65535:
        p.error("--port must be in 0..65535")
    if args.limit_images_per_request < 0:
        p.error("--limit-images-per-request must be >= 0")
    args.api_key = gateway.api_key if args.api_key is None else args.api_key
    if any(not key or "," in key or key != key.strip() or not key.isprintable() for key in args.api_key):
        p.error("an --api-key must be non-empty printable text without commas or surrounding spaces")
    try:
        args.policy = RestartPolicy(args.restart_backoff_s, args.restart_max_backoff_s, args.restart_limit,
                                    args.restart_window_s)
    except ValueError as exc:
        p.error(str(exc))
    return args


def plan_addresses(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every worker's address, fixed before any starts (a restart reuses it)."""
    counts = {"encoder": args.encoders, "prefill": args.prefills, "decode": args.decodes}
    return {role: [f"{WORKER_HOST}:{free_port(WORKER_HOST)}" for _ in range(counts[role])] for role in ROLES}


def child_environments(args: argparse.Namespace, addrs: dict[str, list[str]],
                       environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(every worker's environment, the gateway's)."""
    env = {**environ, "PYTHONUNBUFFERED": "1"}
    if args.redis_url:
        env["EPD_REDIS_URL"] = args.redis_url
    else:
        env.pop("EPD_REDIS_URL", None)
    env.pop("EPD_ADVERTISE_HOST", None)      # workers listen on loopback and advertise that
    env["EPD_INTERNAL_TOKEN"] = environ.get("EPD_INTERNAL_TOKEN") or secrets.token_urlsafe(32)
    for role in ROLES:
        name = f"EPD_{role.upper()}_ADDRS"
        if addrs[role]:
            env[name] = ",".join(addrs[role])
        else:
            env.pop(name, None)
    workers = {k: v for k, v in env.items() if k != "EPD_API_KEY"}
    gateway = dict(workers)
    gateway.setdefault("OMP_NUM_THREADS", str(worker_threads("gateway", addrs, args.device)))
    if args.api_key:
        gateway["EPD_API_KEY"] = ",".join(args.api_key)
    return workers, gateway


def observability_flags(args: argparse.Namespace) -> list[str]:
    """``--log-format`` and ``--otlp-traces-endpoint``, the same for every child."""
    flags = ["--log-format", args.log_format]
    if args.otlp_traces_endpoint:
        flags += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return flags


def worker_threads(role: str, addrs: dict[str, list[str]], device: str, cpus: int | None = None,
                   small_model: bool = False) -> int:
    """A process's torch threads when serve's environment does not fix ``OMP_NUM_THREADS``: the
    cores split among the decode workers for each of them, an even share of all model workers
    for the others (at least 1; 1 on CUDA, where the GPU does the work, and for a small model,
    whose ops are too small to split: ``runtime/worker/threads.py``)."""
    if device != "cpu" or small_model:
        return 1
    cpus = cpus or os.cpu_count() or 1
    if role == "decode":
        return max(1, cpus // max(1, len(addrs["decode"])))
    return max(1, cpus // max(1, sum(len(a) for a in addrs.values())))


def worker_specs(args: argparse.Namespace, worker: WorkerSettings, addrs: dict[str, list[str]],
                 env: dict[str, str]) -> list[ChildSpec]:
    """Every worker's command and environment: ``env`` plus its role's ``OMP_NUM_THREADS``
    (``worker_threads``) and, with ``--cpu-bind auto`` or ``reserve`` on the CPU, its own cores (``EPD_CPU_CORES``,
    ``launcher/cpu_layout.py``), each unless ``env`` already sets it (serve's own environment did)."""
    small = _small_checkpoint(args.model)
    specs = []
    n = 0
    for role in ROLES:
        for i, address in enumerate(addrs[role]):
            argv = [*EXE, role, "--model", args.model, "--host", WORKER_HOST, "--port", address.rsplit(":", 1)[1],
                    "--device", args.device, "--limit-images-per-request", str(args.limit_images_per_request)]
            argv += observability_flags(args)
            if worker.metrics_port:          # one port each, from the one configured on
                argv += ["--metrics-port", str(worker.metrics_port + n)]
            if role == "decode" and worker.bulk_port:
                argv += ["--bulk-port", str(worker.bulk_port + i)]
            if role == "decode" and not args.prefix_cache:
                argv += ["--no-prefix-cache"]
            if role in ("decode", "prefill") and not args.sliding_window_kv:
                argv += ["--no-sliding-window-kv"]
            child_env = {"OMP_NUM_THREADS": str(worker_threads(role, addrs, args.device, small_model=small)), **env}
            specs.append(ChildSpec(role, address, argv, child_env, functools.partial(grpc_serving, address),
                                   stop_group=1, stop_timeout_s=worker.drain_timeout_s + STOP_GRACE_S))
            n += 1
    if args.device != "cpu" or CORES_ENV in env or not hasattr(os, "sched_getaffinity"):
        return specs
    if args.cpu_bind == "reserve":
        _reserve_cores(specs, env)
    elif args.cpu_bind == "auto":
        order = sorted(specs, key=lambda sp: BIND_ORDER.index(sp.role))   # decode first: its step is on every token's path
        cores = plan_cores([int(sp.env["OMP_NUM_THREADS"]) for sp in order], sorted(os.sched_getaffinity(0)))
        for sp, mine in zip(order, cores):
            if mine is not None:
                sp.env[CORES_ENV] = format_cores(mine)
    return specs


def _reserve_cores(specs: list[ChildSpec], env: dict[str, str]) -> None:
    """``--cpu-bind reserve`` (``cpu_layout.plan_reserved``): each decode worker's model thread on its
    own cores, its process and every other worker on the cores left, one torch thread per core
    each (``OMP_NUM_THREADS`` unless ``env`` fixes it)."""
    decodes = [sp for sp in specs if sp.role == "decode"]
    planned = plan_reserved(len(decodes), sorted(os.sched_getaffinity(0)))
    assert planned is not None, "parse_args refuses a host with too few cores"
    model, rest = planned
    for sp in specs:
        mine = model[decodes.index(sp)] if sp.role == "decode" else None
        if mine:
            sp.env[MODEL_CORES_ENV] = format_cores(mine)
        if "OMP_NUM_THREADS" not in env:
            sp.env["OMP_NUM_THREADS"] = str(len(mine or rest))
        sp.env[CORES_ENV] = format_cores(rest)


def _small_checkpoint(model: str) -> bool:
    """Whether ``model``'s weight files are under the size a worker runs on one thread."""
    from runtime.worker.threads import SMALL_MODEL_BYTES

    size = checkpoint_weight_bytes(model)
    return size is not None and size < SMALL_MODEL_BYTES


def gateway_spec(args: argparse.Namespace, gateway: GatewaySettings, env: dict[str, str]) -> ChildSpec:
    argv = [*EXE, "gateway", "--model", args.model, "--served-model-name", args.served_model_name,
            "--host", args.host, "--port", str(args.port), "--placement", args.placement,
            "--limit-images-per-request", str(args.limit_images_per_request), *observability_flags(args)]
    return ChildSpec("gateway", f"{args.host}:{args.port}", argv, env, functools.partial(accepting, args.host, args.port),
                     stop_group=0, stop_timeout_s=gateway.drain_timeout_s + STOP_GRACE_S)


def required_roles(args: argparse.Namespace) -> frozenset[str]:
    """Roles without which the stack cannot answer: prefill only when every request needs one."""
    return frozenset({"encoder", "decode", "gateway"} | ({"prefill"} if args.placement == "disaggregated" else set()))


def main(argv: list[str]) -> int:
    worker, gateway, serve = _load_settings()
    args = parse_args(argv, worker, gateway, serve)
    from runtime.model.supported_models import UnsupportedModel, check_checkpoint
    try:
        check_checkpoint(args.model)   # before any child: one line and a non-zero exit, not N failing workers
    except (UnsupportedModel, OSError) as exc:
        print("epd serve: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    if args.port == 0:
        args.port = free_port(args.host)
    problem = _cannot_listen(args.host, args.port)
    if problem:   # found now, not after every worker has loaded and the gateway crashed five times
        print(f"epd serve: cannot listen on {args.host}:{args.port}: {problem}", file=sys.stderr)
        return 1
    addrs = plan_addresses(args)
    worker_env, gateway_env = child_environments(args, addrs, dict(os.environ))
    supervisor = Supervisor(args.policy, required_roles(args))
    restore = install_stop_signals(supervisor)
    try:
        return supervisor.run(worker_specs(args, worker, addrs, worker_env), gateway_spec(args, gateway, gateway_env),
                              functools.partial(_print_table, args))
    finally:
        restore()


def _print_table(args: argparse.Namespace, children: list[Child]) -> None:
    print(f"\nepd serving {args.served_model_name} ({args.model}) on {args.device}")
    print(f"OpenAI API: http://{args.host}:{args.port}/v1   (status: http://{args.host}:{args.port}/status)\n")
    print(f"{'role':<9}{'address':<24}{'pid':<9}cores")
    for c in children:
        model = c.spec.env.get(MODEL_CORES_ENV)
        cores = c.spec.env.get(CORES_ENV) or "any"
        print(f"{c.spec.role:<9}{c.spec.address:<24}{c.process.pid!s:<9}{f'model {model}, rest {cores}' if model else cores}")
    print("\nCrashed processes are restarted. Ctrl-C to stop.", flush=True)
