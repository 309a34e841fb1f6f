"""Record the worker-stats snapshots ``tests/test_policy_inputs.py`` replays (not a test).

    flock /tmp/epd-heavy.lock .venv/bin/python tests/data/record_worker_stats.py

Starts one encoder, one decode and one prefill worker on the demo model (``tests/cluster.py``),
a real ``Orchestrator`` on them, and records what its registry holds: every healthy worker's
last ``WorkerStats`` (timing samples left out) with the gateway's own count of requests on it,
and the gateway's remote requests still without a first token. Once idle, once at the most
loaded moment of a burst of concurrent image requests (polled every 100 ms). Writes
``tests/data/worker_stats.json``.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

from google.protobuf import json_format

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from cluster import DEMO_MODEL, Cluster  # noqa: E402

from gateway.chat_backend import ChatJob, PreparedImage  # noqa: E402
from gateway.orchestrator import Orchestrator  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from gateway.worker_registry import ROLES  # noqa: E402
from runtime.demo_model.shapes import QUESTIONS, draw_shape  # noqa: E402
from runtime.model.sampling import SamplingParams  # noqa: E402

BURST, MAX_TOKENS = 24, 48


def record(o: Orchestrator) -> dict:
    workers = []
    for role in ROLES:
        for h in o.registry.healthy(role):
            stats = json_format.MessageToDict(h.stats, preserving_proto_field_name=True)
            stats.pop("samples", None)
            workers.append({"role": role, "address": h.address, "inflight": h.inflight, "stats": stats})
    return {"workers": workers, "kv_transfers": o.admission.kv_transfers, "kv_bytes": o.admission.kv_bytes}


def load(snapshot: dict) -> int:
    return sum(w["inflight"] + w["stats"].get("running_seqs", 0) + w["stats"].get("queue_depth", 0)
               for w in snapshot["workers"])


async def main() -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(DEMO_MODEL)
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="epd-record-")))
    try:
        encoder = cluster.start("encoder")
        decode = cluster.start("decode")
        prefill = cluster.start("prefill")
        cluster.wait_healthy()
        settings = GatewaySettings(encoder_addrs=[encoder.address], prefill_addrs=[prefill.address],
                                   decode_addrs=[decode.address])
        o = Orchestrator(settings)
        await o.start()
        try:
            await asyncio.sleep(1.0)
            await o.registry.refresh()
            idle = record(o)

            async def one(seed: int) -> None:
                sample = draw_shape(random.Random(seed))
                text = processor.apply_chat_template([{"role": "user", "content": [
                    {"type": "image"}, {"type": "text", "text": QUESTIONS[seed % len(QUESTIONS)]}]}],
                    add_generation_prompt=True)
                ids = processor(images=[sample.image], text=text, return_tensors="pt")["input_ids"][0].tolist()
                buf = io.BytesIO()
                sample.image.save(buf, "PNG")
                now = time.monotonic()
                job = ChatJob(uuid.uuid4().hex, ids, [PreparedImage(buf.getvalue(), sample.image)], MAX_TOKENS,
                              SamplingParams(), now + 60.0, 1000.0, now)
                async for _ in o.generate(job):
                    pass

            tasks = [asyncio.create_task(one(5000 + i)) for i in range(BURST)]
            loaded = record(o)
            while not all(t.done() for t in tasks):
                await asyncio.sleep(0.1)
                await o.registry.refresh()
                now = record(o)
                if load(now) > load(loaded):
                    loaded = now
            for t in tasks:
                t.result()
        finally:
            await o.close()
    finally:
        cluster.stop()
    out = {"recorded_by": "tests/data/record_worker_stats.py", "model": "models/demo-vlm",
           "settings": {"placement": settings.placement, "prefill_chunk_tokens": settings.prefill_chunk_tokens,
                        "itl_slo_ms": settings.itl_slo_ms, "ttft_slo_ms": settings.ttft_slo_ms},
           "snapshots": {"idle": idle, "loaded": loaded}}
    (HERE / "worker_stats.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"idle load {load(idle)}, loaded {load(loaded)}: wrote {HERE / 'worker_stats.json'}")


if __name__ == "__main__":
    asyncio.run(main())
