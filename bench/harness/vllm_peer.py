"""vLLM's CPU build as a benchmark peer: its own venv, a converted copy of our checkpoint, its server.

Nothing here is an epd dependency: the venv is built by ``bench/vllm_setup.sh`` outside the
repository's ``.venv`` (``BENCH_VLLM_VENV``, default ``/work/.vllm-venv``).

* ``peer_checkpoint``: our checkpoints name the vision tower's weights ``vision_tower.<name>``;
  vLLM's LLaVA loader expects ``vision_tower.vision_model.<name>``. A copy with those keys
  renamed (every other file linked) is written once per source under ``/tmp``; the source is
  never touched.
* ``vllm_serve``: ``HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 vllm serve
  DIR --served-model-name NAME --max-model-len 4096 --dtype float32`` (without
  ``VLLM_TARGET_DEVICE=cpu`` platform detection fails and the AVX-512 kernel library dies
  with SIGILL on an AVX2 host). It is ready when ``/v1/models`` answers (90-120 s here).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .servers import Process, StartError, bench_process

DEFAULT_VENV = Path("/work/.vllm-venv")
VISION_PREFIX = "vision_tower."
VLLM_VISION_PREFIX = "vision_tower.vision_model."


def vllm_venv() -> Path:
    return Path(os.environ.get("BENCH_VLLM_VENV", str(DEFAULT_VENV)))


def vllm_bin() -> Path:
    """The peer's ``vllm`` CLI; ``StartError`` naming the setup script when it is missing."""
    path = vllm_venv() / "bin" / "vllm"
    if not path.exists():
        raise StartError(f"no vLLM peer at {path}: run bench/vllm_setup.sh (BENCH_VLLM_VENV picks the venv)")
    return path


def rename_key(key: str) -> str:
    """``vision_tower.X`` -> ``vision_tower.vision_model.X`` (already-converted keys stay)."""
    if key.startswith(VISION_PREFIX) and not key.startswith(VLLM_VISION_PREFIX):
        return VLLM_VISION_PREFIX + key[len(VISION_PREFIX):]
    return key


def peer_checkpoint(src: Path, root: Path = Path("/tmp/epd-vllm-checkpoints")) -> Path:
    """A copy of ``src`` whose safetensors use vLLM's vision-tower names (built once per source)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = src.resolve()
    stamp = hashlib.sha1(json.dumps(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                            for p in src.iterdir() if p.is_file())).encode()).hexdigest()[:12]
    out = root / f"{src.name}-{stamp}"
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if not path.is_file():
            continue
        target = out / path.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                tensors = {rename_key(k): f.get_tensor(k) for k in f.keys()}
                metadata = f.metadata()
            save_file(tensors, str(target), metadata=metadata)
        elif path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            index["weight_map"] = {rename_key(k): v for k, v in index["weight_map"].items()}
            target.write_text(json.dumps(index))
        else:
            target.symlink_to(path)
    (out / ".complete").write_text("ok\n")
    return out


def vllm_serve(model: Path, port: int, logs: Path, name: str, threads: int | None = None) -> Process:
    """``vllm serve`` of a converted copy of ``model`` on loopback ``port``, served as ``name``."""
    ckpt = peer_checkpoint(model)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [str(vllm_bin()), "serve", str(ckpt), "--served-model-name", name, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "4096", "--dtype", "float32"]
    return bench_process("vllm serve", cmd, logs / f"vllm-serve-{port}.log", env, stop_timeout_s=30.0)
