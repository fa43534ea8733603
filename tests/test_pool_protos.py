"""The checked-in generated code is exactly what protos/generate.sh makes from the .proto files, and it
imports as onestream.protos.onestream.v1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROTOS = Path(__file__).resolve().parents[1] / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_checked_in_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(PROTOS / "generate.sh"), str(tmp_path)], check=True, env=env, timeout=120)
    fresh = {
        p.name: p.read_text()
        for p in (tmp_path / "onestream" / "v1").iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    }
    checked_in = {
        p.name: p.read_text()
        for p in (PROTOS / "onestream" / "v1").iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    }
    assert fresh, "generate.sh produced nothing"
    assert sorted(fresh) == sorted(checked_in)
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"{stale} differ from protos/generate.sh output: run protos/generate.sh and commit"


def test_generated_code_imports_as_a_subpackage() -> None:
    from onestream.protos.onestream.v1 import onestream_pb2, onestream_pb2_grpc

    assert onestream_pb2.DESCRIPTOR.package == "onestream.v1"
    assert "from . import onestream_pb2" in Path(onestream_pb2_grpc.__file__).read_text()
    service = onestream_pb2.DESCRIPTOR.services_by_name["OneStream"]
    assert {"Generate", "Abort", "CloseSession", "ListCards", "ListSessions", "GetModelInfo"} <= {
        m.name for m in service.methods
    }
