"""A real ``epd serve --decodes 2`` that loses a decode worker under load, and what serve hands its children.

One stack for the module (starting it costs seconds of CPU), configured through the
environment as a container would be (``EPD_HOST=0.0.0.0``, ``EPD_PORT``,
``EPD_SERVED_MODEL_NAME``, ``EPD_PLACEMENT`` ...):

1. the settings reached the processes: the gateway listens on 0.0.0.0, the workers on
   loopback, ``/v1/models`` and ``/status`` show the name and placement; every child has the
   peer lists and one internal token (never printed), the gateway alone the API keys;
2. SIGKILL of a decode worker while 8 clients stream: every request ends in time with an
   answer or a clean error (never a 500 or a cut connection), the killed worker is routed
   around, restarted on its address and serves again, and nothing is left held
   (``tests/leaks.py``: every worker serve runs, the gateway's counters, the reaper idle);
3. a request placed on a decode worker that died before the gateway's poll noticed is re-placed
   on the other one (nothing had been sent anywhere yet), and nothing is left held;
4. SIGTERM stops everything: exit 0, no process left, no restart during the shutdown;
5. (its own serve) workers that cannot start are retried with backoff, then given up on loudly,
   and serve exits 1.

Transfers are slowed (the prefill worker delays every KV chunk) so that requests are in
flight on the decode workers when one is killed; leases outlast the test, so the lease
reaper cannot hide a leak.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from cluster import DEMO_MODEL
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from leaks import LeakCheck, http_gateway_counters, orchestrator_counters
from runtime.demo_model.shapes import draw_shape
from test_faults import make_job, processor, run_job  # noqa: F401  (processor is a fixture)

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "shapes-vlm"
API_KEYS = ("key-one", "key-two")
TTFT_SLO_MS = 20000
CLIENTS = 8
LATE_S = 5.0                 # how far past its deadline a request may end (the gateway's guard and teardown)
CLEAN_STATUSES = {429, 503, 504}
CLEAN_STREAM_CODES = {"backend_failure", "deadline_exceeded", "admission_refused"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    proc: subprocess.Popen
    base: str
    port: int
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self) -> dict[str, list[psutil.Process]]:
        by_role: dict[str, list[psutil.Process]] = {}
        for p in psutil.Process(self.proc.pid).children():
            try:
                by_role.setdefault(p.cmdline()[3], []).append(p)
            except (psutil.NoSuchProcess, IndexError):
                pass
        return by_role

    def status(self) -> dict:
        return httpx.get(f"{self.base}/status", headers=HEADERS, timeout=5).json()


HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}   # the gateway's side of the keys lands separately


def _port_of(p: psutil.Process) -> str:
    cmd = p.cmdline()
    return cmd[cmd.index("--port") + 1]


def _leak_check(stack: Stack) -> LeakCheck:
    """Every worker serve runs, by address (a worker restarted there is checked in its place),
    with the stack's internal token, and the gateway's counters from its /status."""
    children = stack.children()
    workers = {role: sorted(f"127.0.0.1:{_port_of(p)}" for p in children.get(role, []))
               for role in ("encoder", "prefill", "decode")}
    return LeakCheck(workers=workers, token=children["decode"][0].environ()["EPD_INTERNAL_TOKEN"],
                     gateways=[http_gateway_counters(stack.base, HEADERS)]).begin()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve-supervision") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("EPD_INTERNAL_TOKEN", "EPD_API_KEY", "EPD_REDIS_URL")}
    env.update(PYTHONUNBUFFERED="1", EPD_HOST="0.0.0.0", EPD_PORT=str(port), EPD_SERVED_MODEL_NAME=MODEL_NAME,
               EPD_PLACEMENT="disaggregated", EPD_PREFILL_CHUNK_TOKENS="8", EPD_FAULTS="delay_chunk_ms=150",
               EPD_LEASE_MARGIN_S="600", EPD_TTFT_SLO_MS=str(TTFT_SLO_MS), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "--decodes", "2", "--restart-backoff-s", "0.5",
           *(a for key in API_KEYS for a in ("--api-key", key))]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    s = Stack(proc, f"http://127.0.0.1:{port}", port, log)
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"epd serve exited with {proc.returncode}:\n{s.text()[-4000:]}")
        try:
            if httpx.get(f"{s.base}/health", headers=HEADERS, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"epd serve not healthy:\n{s.text()[-4000:]}")
        time.sleep(0.5)
    yield s
    if proc.poll() is None:
        procs = [p for ps in s.children().values() for p in ps]
        proc.kill()
        proc.wait()
        for p in procs:
            p.kill()


# -- 1. settings -------------------------------------------------------------------------------

def test_env_settings_and_wiring_reach_every_process(stack):
    children = stack.children()
    assert sorted((r, len(ps)) for r, ps in children.items()) == [
        ("decode", 2), ("encoder", 1), ("gateway", 1), ("prefill", 1)]
    (gateway,) = children["gateway"]
    listening = {(c.laddr.ip, c.laddr.port) for c in gateway.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert ("0.0.0.0", stack.port) in listening, listening
    for p in children["decode"] + children["encoder"] + children["prefill"]:
        worker_listens = {c.laddr.ip.removeprefix("::ffff:") for c in p.net_connections(kind="tcp")
                          if c.status == psutil.CONN_LISTEN and c.laddr.port == int(_port_of(p))}
        assert worker_listens == {"127.0.0.1"}, worker_listens

    models = httpx.get(f"{stack.base}/v1/models", headers=HEADERS, timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert stack.status()["placement_mode"] == "disaggregated"

    addrs = {role: sorted(f"127.0.0.1:{_port_of(p)}" for p in children[role]) for role in ("encoder", "prefill", "decode")}
    tokens = set()
    for role, procs in children.items():
        for p in procs:
            env = p.environ()
            for peer_role, expected in addrs.items():
                assert sorted(env[f"EPD_{peer_role.upper()}_ADDRS"].split(",")) == expected, (role, peer_role)
            tokens.add(env["EPD_INTERNAL_TOKEN"])
            if role == "gateway":
                assert env["EPD_API_KEY"] == ",".join(API_KEYS)
            else:
                assert "EPD_API_KEY" not in env
    (token,) = tokens                                   # one token, shared by the whole stack
    assert len(token) >= 32
    assert token not in stack.text(), "the internal token must never be printed"


# -- 2. a decode worker killed under load -------------------------------------------------------

def _image_request(seed: int, stream: bool) -> tuple[dict, str]:
    sample = draw_shape(random.Random(seed))
    buf = io.BytesIO()
    sample.image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is in the image?"}]}]}
    return body, sample.answer


@dataclass
class Outcome:
    kind: str        # "ok", "clean" (an error the client can read) or "bad"
    detail: str
    secs: float
    started: float   # time.monotonic() when it was sent


@functools.cache
def _generated(seed: int) -> str:
    """The shipped model's own greedy answer for this seed's image (``generate()``, in process): the
    reference a reply must equal where the model misreads an image (it does, rarely)."""
    from transformers import AutoProcessor

    processor, model = AutoProcessor.from_pretrained(DEMO_MODEL), _reference_model()
    image = draw_shape(random.Random(seed)).image
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    enc = processor(text=processor.apply_chat_template(messages, add_generation_prompt=True), images=[image],
                    return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:]
    return processor.decode(out, skip_special_tokens=True).strip()


@functools.cache
def _reference_model():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(DEMO_MODEL).eval()


def _right(text: str, seed: int, answer: str) -> bool:
    return text.strip() == answer or text.strip() == _generated(seed)


async def _one(client: httpx.AsyncClient, seed: int, stream: bool) -> Outcome:
    body, answer = _image_request(seed, stream)
    t0 = time.monotonic()

    def done(kind: str, detail: str) -> Outcome:
        return Outcome(kind, detail, time.monotonic() - t0, t0)

    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={**HEADERS, "x-ttft-slo-ms": str(TTFT_SLO_MS)}) as r:
            if r.status_code != 200:
                payload = json.loads(await r.aread())
                clean = r.status_code in CLEAN_STATUSES and payload.get("error", {}).get("message")
                return done("clean" if clean else "bad", f"HTTP {r.status_code}: {payload}")
            if not stream:
                content = json.loads(await r.aread())["choices"][0]["message"]["content"]
                return done("ok" if _right(content, seed, answer) else "bad", f"answer {content!r}, expected {answer!r}")
            text, finish, ended = "", None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    ended = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    code = event["error"].get("code")
                    return done("clean" if code in CLEAN_STREAM_CODES else "bad", f"stream error {event['error']}")
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
            if ended and finish and _right(text, seed, answer):
                return done("ok", "")
            return done("bad", f"stream ended without an error: [DONE]={ended} finish={finish} text={text!r}")
    except httpx.HTTPError as exc:
        return done("bad", f"transport: {exc!r}")


async def _load(stack: Stack, stop: asyncio.Event, outcomes: list[Outcome], first_seed: int) -> None:
    timeout = httpx.Timeout(TTFT_SLO_MS / 1000 + 30)
    async with httpx.AsyncClient(base_url=stack.base, timeout=timeout) as client:
        async def client_loop(i: int) -> None:
            n = 0
            while not stop.is_set():
                outcomes.append(await _one(client, first_seed + 1000 * i + n, stream=i % 2 == 0))
                n += 1

        await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))


def _replacement(stack: Stack, address: str, old_pid: int) -> psutil.Process | None:
    """The decode process serve started on ``address`` in place of ``old_pid``, if any yet."""
    return next((p for p in stack.children().get("decode", [])
                 if p.pid != old_pid and address.endswith(":" + _port_of(p))), None)


def _decode(status: dict, address: str) -> dict:
    return next(w for w in status["decode"] if w["address"] == address)


async def _until(predicate, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not await asyncio.to_thread(predicate):
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_decode_worker_killed_under_load(stack):
    check = _leak_check(stack)
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    load = asyncio.create_task(_load(stack, stop, outcomes, first_seed=100))
    try:
        # a decode worker with requests of this gateway on it right now
        victim_addr: list[str] = []

        def busy_decode() -> bool:
            busy = [w for w in stack.status()["decode"] if w["inflight_from_gateway"] > 0 and w["healthy"]]
            victim_addr[:] = [max(busy, key=lambda w: w["inflight_from_gateway"])["address"]] if busy else []
            return bool(victim_addr) and len(outcomes) >= 2
        await _until(busy_decode, 60, "requests in flight on a decode worker")
        (address,) = victim_addr
        victim = next(p for p in stack.children()["decode"] if address.endswith(":" + _port_of(p)))
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        marked = await _until(lambda: not _decode(stack.status(), address)["healthy"], 3, "the killed worker marked unhealthy")
        assert marked < 3
        await asyncio.sleep(4)                          # the load goes on while the worker is down and restarting
        back = await _until(lambda: _decode(stack.status(), address)["healthy"], 30 - (time.monotonic() - killed_at),
                            "the restarted worker healthy in /status")
        stop.set()
        await asyncio.wait_for(load, TTFT_SLO_MS / 1000 + LATE_S + 30)
    finally:
        stop.set()
        if not load.done():
            load.cancel()
    assert stack.proc.poll() is None, f"epd serve must survive a worker's death:\n{stack.text()[-3000:]}"
    assert _replacement(stack, address, victim.pid) is not None
    assert f"decode at {address} exited with SIGKILL; restarting" in stack.text()

    bad = [o for o in outcomes if o.kind == "bad"]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests ended badly: {[o.detail for o in bad][:5]}"
    late = [o.secs for o in outcomes if o.secs > TTFT_SLO_MS / 1000 + LATE_S]
    assert not late, f"requests past their deadline: {late}"
    # only a request already streaming from the killed worker may fail (its tokens cannot be
    # taken back); one sent after the kill finds the survivor (a failed Reserve re-places it)
    after = [o.detail for o in outcomes if o.kind != "ok" and o.started > killed_at]
    assert not after, f"requests sent after the kill failed: {after[:5]}"
    assert sum(o.kind == "ok" for o in outcomes) >= CLIENTS, [o.detail for o in outcomes]

    # the replacement serves: pairs of overlapping requests until one has run on it
    async with httpx.AsyncClient(base_url=stack.base, timeout=httpx.Timeout(60)) as client:
        for round_ in range(5):
            results = await asyncio.gather(*(_one(client, 900 + 2 * round_ + k, stream=bool(k)) for k in range(2)))
            assert [o.kind for o in results] == ["ok", "ok"], [o.detail for o in results]
            if await asyncio.to_thread(lambda: _decode(stack.status(), address).get("max_batch_observed", 0) >= 1):
                break
        else:
            pytest.fail("no request ran on the restarted decode worker")

    # nothing held anywhere (leases outlast the test: the reaper did not clean up)
    await check.settled()
    print(f"\n{len(outcomes)} requests: {sum(o.kind == 'ok' for o in outcomes)} ok, "
          f"{sum(o.kind == 'clean' for o in outcomes)} clean errors; marked unhealthy in {marked:.1f} s, "
          f"healthy again {back + 4 + marked:.1f} s after the kill")


# -- 3. a request placed on a worker that has just died ---------------------------------------

async def test_request_placed_on_a_just_dead_worker_moves_to_another(stack, processor, monkeypatch):
    """Before the gateway's poll has noticed, a request is placed on the dead worker: its Reserve
    fails, nothing has been sent anywhere, so it is re-placed on the other decode worker."""
    check = _leak_check(stack)
    children = stack.children()
    monkeypatch.setenv("EPD_INTERNAL_TOKEN", children["decode"][0].environ()["EPD_INTERNAL_TOKEN"])
    addrs = {f"{role}_addrs": [f"127.0.0.1:{_port_of(p)}" for p in children[role]] for role in ("encoder", "prefill", "decode")}
    orch = Orchestrator(GatewaySettings(**addrs, placement="disaggregated", prefill_chunk_tokens=64))
    orch.registry.poll_s = 3600            # one refresh at start, then the registry's view stays as it was
    check.gateways.append(orchestrator_counters(orch))
    await orch.start()
    try:
        victim, survivor = children["decode"]
        address = f"127.0.0.1:{_port_of(victim)}"
        dead, alive = orch.registry.get("decode", address), orch.registry.get("decode", f"127.0.0.1:{_port_of(survivor)}")
        assert dead.healthy and alive.healthy
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        alive.inflight += 100              # the placement now prefers the (dead) idle-looking worker
        try:
            job, answer = make_job(processor, 77, 15.0)
            outcome, text, secs = await run_job(orch, processor, job)
        finally:
            alive.inflight -= 100
        assert (outcome, text) == ("ok", answer), outcome
        assert not dead.healthy, "the failed Reserve marked the dead worker"
        assert dead.inflight == 0 and alive.inflight == 0
    finally:
        await orch.close()
    await _until(lambda: _replacement(stack, address, victim.pid) is not None and _decode(stack.status(), address)["healthy"],
                 30, "the restarted worker healthy again")
    await check.settled()


# -- 4. stop ------------------------------------------------------------------------------------

def test_sigterm_stops_everything_with_exit_0(stack):
    procs = [p for ps in stack.children().values() for p in ps]
    assert len(procs) == 5
    restarts_before = stack.text().count("restarted ")
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=90) == 0, stack.text()[-3000:]
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    assert stack.text().count("restarted ") == restarts_before, "nothing restarts during the shutdown"


# -- 5. a worker that cannot start ---------------------------------------------------------------

def test_a_worker_that_keeps_crashing_is_given_up_on_loudly(tmp_path):
    """A checkpoint whose weights are missing (config, tokenizer and processor are there, so the
    start-up check passes): every worker exits at start. Serve restarts each with backoff, gives
    up after the limit with one line naming role, address and exit codes, and, with a required
    stage gone, stops everything and exits non-zero."""
    empty_model = tmp_path / "not-a-model"
    empty_model.mkdir()
    for f in DEMO_MODEL.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, empty_model / f.name)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "--model", str(empty_model), "--prefills", "0",
           "--placement", "colocated", "--port", str(_free_port()),
           "--restart-backoff-s", "0.1", "--restart-limit", "3", "--restart-window-s", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    gave_up = re.findall(r"epd serve: giving up on (encoder|decode) at 127\.0\.0\.1:\d+: it exited 3 times "
                         r"within 120 s \(exit codes 1, 1, 1\)", out)
    assert gave_up, out[-3000:]
    lost = re.findall(r"epd serve: no (\w+) left running; stopping everything", out)
    assert len(lost) == 1 and lost[0] in gave_up, out[-3000:]
    assert out.count("restarting in 0.1 s") + out.count("restarting in 0.2 s") >= 2   # it did back off and retry
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(empty_model) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left behind: {left}"
