"""`epd serve` brings up the whole stack, answers an image chat correctly, and Ctrl-C leaves nothing behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from shape_images import shape_data_url

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``epd serve FLAGS`` on a free port, once every stage is healthy."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--port", str(port), *flags], cwd=ROOT,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"epd serve exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"epd serve not healthy:\n{log.read_text()}")
    return proc, base


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, base = _serve(log)
    children = psutil.Process(proc.pid).children(recursive=True)
    yield proc, base, children, log
    if proc.poll() is None:
        proc.kill()


def _image_url(seed: int) -> tuple[str, str]:
    url, sample = shape_data_url(seed)
    return url, sample.answer


def test_serve_answers_image_chat(served):
    _, base, _, _ = served
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    for seed in (11, 12):
        url, answer = _image_url(seed)
        reply = client.chat.completions.create(
            model="demo-vlm", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is in the image?"}]}])
        assert reply.choices[0].message.content.strip() == answer
        assert reply.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10
    while True:  # the gateway polls worker stats every 0.5 s: a snapshot may predate the second answer's end
        status = httpx.get(f"{base}/status").json()
        settled = all(w.get("reservations_active") == 0 and w.get("pending_chunks") == 0 for w in status.get("decode", []))
        encoded = status["encoder"][0].get("computes", 0) + sum(w.get("images_encoded_here", 0) for w in status["decode"])
        if (encoded >= 2 and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {"encoder", "prefill", "decode"} <= set(status)
    for worker in status["decode"]:
        assert worker["healthy"] and "address" in worker
        assert worker["reservations_active"] == 0 and worker["pending_chunks"] == 0
    for worker in [*status["decode"], *status["prefill"]]:   # the kernel each selected at start-up (CPU)
        assert worker["attention_kernel"] == "sdpa_padded"
    for worker in [*status["decode"], *status["prefill"], *status["encoder"]]:
        assert worker["linear_kernel"] == "torch"   # the demo model's layers are all under oneDNN's threshold
    # two distinct images, each encoded once: by the encoder, or by the colocated decode worker itself
    assert status["encoder"][0]["computes"] + sum(w["images_encoded_here"] for w in status["decode"]) == 2


def test_gateway_heap_frozen_at_start(served):
    """The gateway froze its start-up heap (tokenizer, processor, app): a full collection skips it
    (``runtime/worker/gc_heap.py``), and its pauses are on ``/metrics``."""
    _, base, _, _ = served
    text = httpx.get(f"{base}/metrics").text
    frozen = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("epd:gc_frozen_objects ")]
    assert frozen and frozen[0] > 100_000
    assert "# TYPE epd:gc_pause_seconds histogram" in text


def test_each_model_worker_runs_on_cores_of_its_own(served):
    """``--cpu-bind auto`` (the default) with the demo model (one thread a process): decode on the
    first core, the encoder on the next, prefill on a third if there is one; the gateway anywhere.
    Every thread of a bound worker (event loop, torch thread, gRPC's) runs on its cores alone."""
    from launcher.cpu_layout import plan_cores

    _, _, children, _ = served
    cpus = sorted(os.sched_getaffinity(0))
    planned = dict(zip(("decode", "encoder", "prefill"), plan_cores([1, 1, 1], cpus)))
    by_role = {}
    for child in children:
        role = next((a for a in child.cmdline() if a in ("encoder", "prefill", "decode", "gateway")), None)
        if role:
            by_role[role] = child
    assert set(by_role) == {"encoder", "prefill", "decode", "gateway"}
    for role, proc in by_role.items():
        expected = set(planned.get(role) or cpus)
        threads = {t.id: set(os.sched_getaffinity(t.id)) for t in proc.threads()}
        assert len(threads) > 1 and all(cores == expected for cores in threads.values()), (role, threads)
    if len(cpus) >= 2:
        assert planned["decode"] == [cpus[0]] and planned["encoder"] == [cpus[1]]
    # ... and each worker's Stats report those cores, which the gateway's placement reads (shared cores)
    status = httpx.get(f"{served[1]}/status").json()
    for role in ("decode", "encoder", "prefill"):
        (worker,) = status[role]
        assert worker["cpus"] == sorted(planned.get(role) or cpus) and -1.0 <= worker["cpus_busy"] <= 1.0


def test_ctrl_c_leaves_no_process(served):
    proc, _, children, log = served
    assert len(children) >= 4  # encoder, prefill, decode, gateway
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {[p.pid for p in alive]}\n{log.read_text()}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_cpu_bind_reserve_runs_the_decode_step_on_a_core_nothing_else_uses(tmp_path):
    """``--cpu-bind reserve``: the decode worker's model thread alone on the first core, its event loop
    and the other workers on the last; ``/status`` reports the cores each model computes on, and the
    stack answers."""
    cpus = sorted(os.sched_getaffinity(0))
    log = tmp_path / "serve.log"
    proc, base = _serve(log, "--cpu-bind", "reserve")
    try:
        url, answer = _image_url(3)
        reply = OpenAI(base_url=f"{base}/v1", api_key="unused").chat.completions.create(
            model="demo-vlm", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is in the image?"}]}])
        assert reply.choices[0].message.content.strip() == answer
        status = httpx.get(f"{base}/status").json()
        assert [w["cpus"] for w in status["decode"]] == [[cpus[0]]]
        assert [w["cpus"] for w in (*status["encoder"], *status["prefill"])] == [[cpus[-1]], [cpus[-1]]]
        decode = next(c for c in psutil.Process(proc.pid).children(recursive=True) if "decode" in c.cmdline())
        threads = {t.id: set(os.sched_getaffinity(t.id)) for t in decode.threads()}
        assert set(os.sched_getaffinity(decode.pid)) == {cpus[-1]}               # its event loop
        assert [t for t, cores in threads.items() if cores == {cpus[0]}]          # its model thread
        assert all(cores in ({cpus[0]}, {cpus[-1]}) for cores in threads.values())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
