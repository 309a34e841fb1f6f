#!/usr/bin/env bash
# Regenerate the gRPC stubs (+ .pyi) from proto/ with the pinned grpcio-tools.
# The generated files are committed; tests/test_protos.py fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/epd/v1/epd.proto
