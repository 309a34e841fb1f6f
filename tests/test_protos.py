"""The committed gRPC stubs are exactly what the pinned grpcio-tools generates from proto/."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("epd_pb2.py", "epd_pb2.pyi", "epd_pb2_grpc.py")


def test_generated_stubs_are_current(tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("__pycache__", "*_pb2*"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.",
         "proto/epd/v1/epd.proto"],
        cwd=tmp_path, check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "proto/epd/v1" / name).read_text()
        committed = (ROOT / "proto/epd/v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen_protos.sh"


def test_protocol_is_versioned():
    from proto.epd.v1 import epd_pb2

    assert epd_pb2.DESCRIPTOR.package == "epd.v1"
    assert set(epd_pb2.DESCRIPTOR.services_by_name) == {"Encoder", "Prefill", "Decode"}
