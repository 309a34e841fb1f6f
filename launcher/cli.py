"""`epd` console script.

Each subcommand lives in the package that owns it and exposes ``main(argv) -> int``.
Imports are lazy so ``epd --help`` and light commands (``simulate``, ``bench``)
never pay for torch or the model.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("launcher.serve", "start encoder, prefill, decode workers and the gateway on this host"),
    "encoder": ("encoder_svc.server", "run one encoder worker (gRPC)"),
    "prefill": ("prefill_svc.server", "run one prefill worker (gRPC)"),
    "decode": ("decode_svc.server", "run one decode worker (gRPC)"),
    "gateway": ("gateway.server", "run the OpenAI-compatible HTTP gateway"),
    "demo-model": ("runtime.demo_model.cli", "build (train) the shipped demo VLM, or the larger bench config"),
    "simulate": ("sim.simulate_cli", "discrete-event simulation of the E/P/D pipeline"),
    "plan": ("sim.plan_cli", "recommend worker counts per stage for a load and SLOs"),
    "profile": ("bench.profile_cli", "measure a running stack's service-time tables"),
    "bench": ("bench.loadgen", "load generator for any OpenAI-compatible chat server"),
    "healthcheck": ("launcher.healthcheck", "exit 0 when a worker (gRPC) or gateway (HTTP) is healthy"),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: epd <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'epd <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"epd: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in PROCESSES:
        from launcher.cpu_layout import bind_from_env

        bind_from_env()   # EPD_CPU_CORES: before the command can start a thread, so all of them inherit it
        warn_unknown_settings(name)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


# the commands that read EPD_* settings: each warns about variables no process reads
PROCESSES = ("serve", "encoder", "prefill", "decode", "gateway")


def warn_unknown_settings(command: str) -> None:
    from launcher.settings_doc import unknown_variables

    for line in unknown_variables(os.environ):
        print(f"epd {command}: warning: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
