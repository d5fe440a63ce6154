"""The committed stubs in services/common/pb/ are what `python scripts/gen_protos.py` makes now."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Generator version stamps differ between grpcio-tools releases without changing the API.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|    \d+,)$", re.M
)


def _normalized(path: Path) -> str:
    return _VERSION_LINES.sub("", path.read_text())


def test_stubs_are_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--out", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    committed = ROOT / "services" / "common" / "pb"
    fresh = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert fresh == sorted(
        p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    )
    stale = [
        name for name in fresh if _normalized(tmp_path / name) != _normalized(committed / name)
    ]
    assert not stale, f"stale stubs {stale}: run `python scripts/gen_protos.py`"


def test_stubs_import_and_round_trip():
    from services.common.pb import common_pb2, generate_pb2

    request = generate_pb2.GenerateRequest(
        text="hi", sampling=common_pb2.SamplingParams(max_tokens=3, stop=["\n"])
    )
    again = generate_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert again.WhichOneof("prompt") == "text" and again.sampling.max_tokens == 3
