"""``epd serve``'s settings and the commands and environments it builds for its children (no processes).

Every default comes from the settings classes (so from ``EPD_*``), a flag overrides it, and
serve passes a child only what it decides itself: the gateway listens on ``EPD_HOST``, the
workers on loopback, one metrics/bulk port each when a base port is set, the peer lists and
the internal token everywhere, the API keys to the gateway alone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from launcher import serve
from launcher.cpu_layout import plan_cores
from launcher.serve_settings import ServeSettings
from runtime.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]


def build(argv: list[str], environ: dict[str, str] | None = None):
    worker, gateway, settings = serve._load_settings()
    args = serve.parse_args(argv, worker, gateway, settings)
    addrs = serve.plan_addresses(args)
    worker_env, gateway_env = serve.child_environments(args, addrs, environ or {})
    workers = serve.worker_specs(args, worker, addrs, worker_env)
    return args, addrs, workers, serve.gateway_spec(args, gateway, gateway_env)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("EPD_"):
            monkeypatch.delenv(name)


def test_every_default_comes_from_the_environment(monkeypatch):
    for name, value in {"EPD_HOST": "0.0.0.0", "EPD_PORT": "9123", "EPD_SERVED_MODEL_NAME": "shapes",
                        "EPD_PLACEMENT": "colocated", "EPD_MODEL": "models/demo-vlm", "EPD_REDIS_URL": "redis://r:6379/2",
                        "EPD_RESTART_BACKOFF_S": "0.25", "EPD_RESTART_LIMIT": "7", "EPD_API_KEY": "a,b"}.items():
        monkeypatch.setenv(name, value)
    args, addrs, workers, gateway = build(["--decodes", "2"])
    assert (args.host, args.port, args.served_model_name, args.placement) == ("0.0.0.0", 9123, "shapes", "colocated")
    assert (args.policy.backoff_s, args.policy.limit) == (0.25, 7)
    assert args.api_key == ["a", "b"]
    assert flag(gateway.argv, "--host") == "0.0.0.0" and flag(gateway.argv, "--port") == "9123"
    assert flag(gateway.argv, "--served-model-name") == "shapes" and flag(gateway.argv, "--placement") == "colocated"
    assert gateway.env["EPD_API_KEY"] == "a,b"
    assert {flag(w.argv, "--host") for w in workers} == {"127.0.0.1"}
    assert [w.role for w in workers] == ["encoder", "prefill", "decode", "decode"]
    for spec in [*workers, gateway]:
        assert spec.env["EPD_REDIS_URL"] == "redis://r:6379/2"
        assert spec.env["EPD_DECODE_ADDRS"] == ",".join(addrs["decode"])


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("EPD_HOST", "0.0.0.0")
    monkeypatch.setenv("EPD_PLACEMENT", "colocated")
    monkeypatch.setenv("EPD_API_KEY", "from-env")
    args, _, _, gateway = build(["--host", "127.0.0.2", "--placement", "disaggregated", "--api-key", "k1",
                                 "--api-key", "k2", "--restart-window-s", "5"])
    assert flag(gateway.argv, "--host") == "127.0.0.2" and flag(gateway.argv, "--placement") == "disaggregated"
    assert gateway.env["EPD_API_KEY"] == "k1,k2"
    assert args.policy.window_s == 5


def test_children_environment(monkeypatch):
    monkeypatch.setenv("EPD_ADVERTISE_HOST", "10.0.0.9")   # meaningless for loopback workers
    args, addrs, workers, gateway = build(["--prefills", "0", "--decodes", "2", "--api-key", "secret-key"])
    token = gateway.env["EPD_INTERNAL_TOKEN"]
    assert len(token) >= 32
    for spec in workers:
        assert spec.env["EPD_INTERNAL_TOKEN"] == token
        assert "EPD_API_KEY" not in spec.env
        assert "EPD_ADVERTISE_HOST" not in spec.env
        assert "EPD_PREFILL_ADDRS" not in spec.env                  # no prefill workers: unset, not ""
        assert spec.env["EPD_ENCODER_ADDRS"] == addrs["encoder"][0]
    assert len(set(addrs["decode"])) == 2
    # a token that is set is used as it is, and each run without one gets its own
    assert serve.child_environments(args, addrs, {"EPD_INTERNAL_TOKEN": "given-token-0123456789"})[0][
        "EPD_INTERNAL_TOKEN"] == "given-token-0123456789"
    assert serve.child_environments(args, addrs, {})[0]["EPD_INTERNAL_TOKEN"] != token


def test_one_metrics_and_bulk_port_per_worker(monkeypatch):
    monkeypatch.setenv("EPD_METRICS_PORT", "9100")
    monkeypatch.setenv("EPD_BULK_PORT", "7000")
    _, _, workers, _ = build(["--decodes", "2"])
    assert [flag(w.argv, "--metrics-port") for w in workers] == ["9100", "9101", "9102", "9103"]
    assert [flag(w.argv, "--bulk-port") for w in workers] == [None, None, "7000", "7001"]
    monkeypatch.delenv("EPD_METRICS_PORT")
    monkeypatch.delenv("EPD_BULK_PORT")
    _, _, workers, _ = build([])
    assert all("--metrics-port" not in w.argv and "--bulk-port" not in w.argv for w in workers)


def test_stop_timeouts_follow_the_drain_timeout(monkeypatch):
    monkeypatch.setenv("EPD_DRAIN_TIMEOUT_S", "120")
    _, _, workers, gateway = build([])
    assert gateway.stop_timeout_s > 120 and all(w.stop_timeout_s > 120 for w in workers)
    assert gateway.stop_group < min(w.stop_group for w in workers)     # the gateway stops first


def test_required_roles():
    def roles(placement: str) -> frozenset[str]:
        args = serve.parse_args(["--placement", placement], WorkerSettings(), GatewaySettings(), ServeSettings())
        return serve.required_roles(args)

    assert roles("disaggregated") == {"encoder", "prefill", "decode", "gateway"}
    assert roles("conditional") == {"encoder", "decode", "gateway"}   # colocated placement still answers


@pytest.mark.parametrize("argv", [
    ["--placement", "disaggregated", "--prefills", "0"],
    ["--api-key", "a,b"],
    ["--api-key", ""],
    ["--api-key", " padded "],
    ["--restart-backoff-s", "5", "--restart-max-backoff-s", "1"],
    ["--restart-limit", "0"],
    ["--decodes", "0"],
])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(argv, WorkerSettings(), GatewaySettings(), ServeSettings())
    assert exc.value.code == 2


def test_a_bad_environment_value_is_refused_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setenv("EPD_PORT", "not-a-port")
    with pytest.raises(SystemExit) as exc:
        serve._load_settings()
    assert exc.value.code == 2
    assert "invalid EPD_* setting" in capsys.readouterr().err


def test_a_gateway_port_in_use_is_refused_before_anything_starts(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        assert serve.main(["--host", "127.0.0.1", "--port", str(port)]) == 1
    assert time.monotonic() - t0 < 5, "refused at once, no worker started"
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_log_format_and_traces_endpoint_reach_every_child(monkeypatch):
    _, _, workers, gateway = build([])
    assert all(flag(c.argv, "--log-format") == "text" and "--otlp-traces-endpoint" not in c.argv
               for c in [*workers, gateway])
    _, _, workers, gateway = build(["--log-format", "json", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"])
    assert all(flag(c.argv, "--log-format") == "json"
               and flag(c.argv, "--otlp-traces-endpoint") == "http://127.0.0.1:4318/v1/traces"
               for c in [*workers, gateway])
    monkeypatch.setenv("EPD_LOG_FORMAT", "json")
    _, _, workers, _ = build([])
    assert all(flag(c.argv, "--log-format") == "json" for c in workers)


def test_no_prefix_cache_reaches_the_decode_workers_alone(monkeypatch):
    _, _, workers, _ = build([])
    assert all("--no-prefix-cache" not in w.argv for w in workers)
    _, _, workers, gateway = build(["--no-prefix-cache", "--decodes", "2"])
    assert [("--no-prefix-cache" in w.argv) for w in workers] == [w.role == "decode" for w in workers]
    assert "--no-prefix-cache" not in gateway.argv
    monkeypatch.setenv("EPD_PREFIX_CACHE", "false")
    args, _, _, _ = build([])
    assert args.prefix_cache is False
    assert WorkerSettings().prefix_cache is False
    from runtime.worker.settings import parse_worker_args
    monkeypatch.delenv("EPD_PREFIX_CACHE")
    assert parse_worker_args("decode", ["--no-prefix-cache"]).prefix_cache is False
    assert parse_worker_args("decode", []).prefix_cache is True


def test_the_decode_worker_gets_the_cores_unless_the_environment_fixes_threads(monkeypatch, tmp_path):
    one = {"encoder": ["e:1"], "prefill": ["p:1"], "decode": ["d:1"]}
    two = {**one, "decode": ["d:1", "d:2"]}
    assert [serve.worker_threads(r, one, "cpu", cpus=2) for r in ("encoder", "prefill", "decode", "gateway")] == [1, 1, 2, 1]
    assert [serve.worker_threads(r, two, "cpu", cpus=8) for r in ("encoder", "decode")] == [2, 4]
    assert serve.worker_threads("decode", one, "cuda", cpus=8) == 1
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 4)
    big = ["--model", str(big_checkpoint(tmp_path))]
    args, addrs, workers, gateway = build(big, {})
    assert {w.role: w.env["OMP_NUM_THREADS"] for w in workers} == {"encoder": "1", "prefill": "1", "decode": "4"}
    assert gateway.env["OMP_NUM_THREADS"] == "1"
    args, addrs, workers, gateway = build(big, {"OMP_NUM_THREADS": "3"})   # serve's own setting wins
    assert {w.env["OMP_NUM_THREADS"] for w in [*workers, gateway]} == {"3"}
    args, addrs, workers, gateway = build([], {})   # the demo model: every process on one thread
    assert {w.env["OMP_NUM_THREADS"] for w in [*workers, gateway]} == {"1"}


def big_checkpoint(tmp_path):
    """A folder whose weight file is 32 MiB (sparse): over the one-thread bound."""
    folder = tmp_path / "big"
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(32 << 20)
    return folder


def test_cpu_bind_reserve_gives_the_decode_model_thread_cores_no_other_thread_has(monkeypatch, tmp_path):
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 2)
    big = ["--model", str(big_checkpoint(tmp_path)), "--cpu-bind", "reserve"]
    args, addrs, workers, gateway = build(big, {})
    layout = {w.role: (w.env.get("EPD_MODEL_CORES"), w.env["EPD_CPU_CORES"], w.env["OMP_NUM_THREADS"]) for w in workers}
    assert layout == {"decode": ("0", "1", "1"), "encoder": (None, "1", "1"), "prefill": (None, "1", "1")}
    assert "EPD_CPU_CORES" not in gateway.env and "EPD_MODEL_CORES" not in gateway.env
    args, addrs, workers, gateway = build(big, {"OMP_NUM_THREADS": "2"})   # serve's own setting wins
    assert {w.env["OMP_NUM_THREADS"] for w in workers} == {"2"}
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 8)
    args, addrs, workers, gateway = build([*big, "--decodes", "2"], {})
    decodes = sorted((w.env["EPD_MODEL_CORES"], w.env["OMP_NUM_THREADS"]) for w in workers if w.role == "decode")
    assert decodes == [("0,1,2", "3"), ("3,4,5", "3")]
    assert {w.env["EPD_CPU_CORES"] for w in workers} == {"6,7"}
    assert {w.env["OMP_NUM_THREADS"] for w in workers if w.role != "decode"} == {"2"}
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0})   # one core: nothing to reserve
    with pytest.raises(SystemExit):
        build(big, {})


def cores_of(workers) -> dict[str, str | None]:
    return {f"{w.role}@{w.address}": w.env.get("EPD_CPU_CORES") for w in workers}


def test_cpu_bind_gives_each_model_worker_cores_of_its_own_while_they_last(monkeypatch, tmp_path):
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 2)
    args, addrs, workers, gateway = build([], {})   # the demo model: one thread each, decode first
    assert {w.role: w.env.get("EPD_CPU_CORES") for w in workers} == {"decode": "0", "encoder": "1", "prefill": None}
    assert "EPD_CPU_CORES" not in gateway.env
    # the bench-sized model: decode's two threads take both cores, so nothing is bound
    args, addrs, workers, gateway = build(["--model", str(big_checkpoint(tmp_path))], {})
    assert set(cores_of(workers).values()) == {None}
    for argv, environ in ((["--cpu-bind", "none"], {}), ([], {"EPD_CPU_BIND": "none"}), (["--device", "cuda"], {})):
        monkeypatch.setenv("EPD_CPU_BIND", environ.get("EPD_CPU_BIND", "auto"))
        args, addrs, workers, gateway = build(argv, environ)
        assert set(cores_of(workers).values()) == {None}, argv
    monkeypatch.delenv("EPD_CPU_BIND")
    args, addrs, workers, gateway = build([], {"EPD_CPU_CORES": "1"})   # serve's own binding: every child's
    assert {w.env["EPD_CPU_CORES"] for w in [*workers, gateway]} == {"1"}
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 8)
    args, addrs, workers, gateway = build(["--model", str(tmp_path / "big"), "--decodes", "2"], {})
    bound = {w.address: w.env.get("EPD_CPU_CORES") for w in workers if w.role == "decode"}
    assert sorted(bound.values()) == ["0,1,2,3", "4,5,6,7"]   # four threads each, on cores no one else has
    assert {w.env.get("EPD_CPU_CORES") for w in workers if w.role != "decode"} == {None}


def test_plan_cores_hands_out_cores_in_order_and_never_shares_one():
    assert plan_cores([1, 1, 1], [0, 1]) == [[0], [1], None]
    assert plan_cores([2, 1, 1], [0, 1]) == [None, None, None]        # decode takes every core: nothing bound
    assert plan_cores([2, 2, 1, 3], [4, 5, 6, 7, 8]) == [[4, 5], [6, 7], [8], None]
    assert plan_cores([3, 1], [0, 1, 2, 3]) == [[0, 1, 2], [3]]
    assert plan_cores([1], [0]) == [None]


def test_a_process_binds_itself_to_epd_cpu_cores_before_it_starts_threads():
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, threading; from launcher.cpu_layout import bind_from_env; bind_from_env(); "
            "t = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0)))); t.start(); t.join()")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EPD_CPU_CORES": str(allowed[-1])},
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == f"[{allowed[-1]}]"   # a thread started later runs on the bound core alone
    bad = subprocess.run([sys.executable, "-m", "launcher.cli", "decode", "--help"],
                         env={**os.environ, "EPD_CPU_CORES": "0,x"}, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "EPD_CPU_CORES" in bad.stderr


