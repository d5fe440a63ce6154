"""Regenerate the Python gRPC stubs from proto/ into services/common/pb/ (one command).

    python scripts/gen_protos.py            # rewrite the committed stubs
    python scripts/gen_protos.py --out DIR  # write elsewhere (the staleness test compares)

protoc emits `from pdserve.v1 import x_pb2`; the imports are rewritten to the package path
`services.common.pb` so the stubs live inside the `services` package.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
DEFAULT_OUT = ROOT / "services" / "common" / "pb"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pdserve" / "v1").glob("*.proto")
    )
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in (out / "pdserve" / "v1").iterdir():
        text = re.sub(
            r"^from pdserve\.v1 import",
            "from services.common.pb import",
            path.read_text(),
            flags=re.M,
        )
        target = out / path.name
        target.write_text(text)
        written.append(target)
        path.unlink()
    (out / "pdserve" / "v1").rmdir()
    (out / "pdserve").rmdir()
    init = out / "__init__.py"
    init.write_text('"""Generated gRPC stubs (scripts/gen_protos.py); do not edit."""\n')
    return sorted([*written, init])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    for path in generate(parser.parse_args().out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
