# syntax=docker/dockerfile:1
#
# One image for every epd service; the command picks the role:
#   docker run --rm -p 8000:8000 epd:cpu                  # `epd serve`: the whole stack in one container
#   docker run ... epd:cpu epd encoder | prefill | decode | gateway
#
# CPU by default:
#   docker build -t epd:cpu .
# CUDA: only the torch wheel index changes. The CUDA wheels bring their own CUDA
# runtime, cuDNN and NCCL as pip packages, so the base stays python:slim and the
# host needs only the NVIDIA driver and the NVIDIA Container Toolkit:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t epd:cuda .
# BASE_IMAGE may be swapped for any Debian/Ubuntu image whose `python` is >= 3.11
# (for instance a CUDA base image with Python, if you need CUDA tools inside);
# build and runtime stages must use the same one, because the venv links to its python.
#
# Health: compose and Kubernetes set a check per service. A bare `docker run`
# uses the HEALTHCHECK below, which runs `epd healthcheck $EPD_HEALTHCHECK_TARGET`
# (default: the gateway at :8000, right for `epd serve` and `epd gateway`); for a
# worker pass e.g. -e EPD_HEALTHCHECK_TARGET=grpc://127.0.0.1:50053.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build stage
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src

# 1. torch, from the chosen index: the largest layer, rebuilt only when the args change.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# 2. the other runtime dependencies, read from pyproject.toml: rebuilt only when it changes.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

# 3. epd itself (no deps: all installed above; torch stays the one from TORCH_INDEX).
COPY README.md ./
COPY runtime/ runtime/
COPY encoder_svc/ encoder_svc/
COPY prefill_svc/ prefill_svc/
COPY decode_svc/ decode_svc/
COPY gateway/ gateway/
COPY cache/ cache/
COPY launcher/ launcher/
COPY sim/ sim/
COPY bench/ bench/
COPY proto/ proto/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
 && epd --help > /dev/null

# -------------------------------------------------------------- runtime stage
FROM ${BASE_IMAGE} AS runtime
# tini as PID 1: forwards SIGTERM (workers drain on it) and reaps `epd serve`'s children.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/epd --shell /usr/sbin/nologin epd

COPY --from=build /opt/venv /opt/venv
COPY models/ /app/models/

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    EPD_MODEL=/app/models/demo-vlm \
    EPD_HOST=0.0.0.0
WORKDIR /app
USER 10001:10001

# gateway HTTP, encoder / prefill / decode gRPC, worker Prometheus metrics
EXPOSE 8000 50051 50052 50053 9100

HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD epd healthcheck "${EPD_HEALTHCHECK_TARGET:-http://127.0.0.1:8000/health}"

ENTRYPOINT ["tini", "--"]
CMD ["epd", "serve"]
