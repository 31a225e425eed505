#!/usr/bin/env python3
"""Generate the CSI gRPC stubs from csi/csi.proto into weightcache/csi/_pb (or --out DIR).

    python scripts/gen_csi.py            # rewrite the committed stubs
    python scripts/gen_csi.py --out DIR  # write them elsewhere (the test compares the two byte for byte)

Uses grpc_tools.protoc (grpcio-tools, pinned in pyproject so the output is reproducible). protoc writes
`import csi_pb2` into the service module; we rewrite it to the package-qualified import, so the stubs never
need `sys.path` tricks and cannot collide with another project's `csi_pb2`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "csi" / "csi.proto"
DEFAULT_OUT = ROOT / "weightcache" / "csi" / "_pb"
PACKAGE = "weightcache.csi._pb"
OUTPUTS = ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Run protoc on csi/csi.proto, writing the three stub files into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    argv = ["grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{well_known}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", PROTO.name]
    if protoc.main(argv) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")
    grpc_module = out / "csi_pb2_grpc.py"
    text = grpc_module.read_text()
    plain = "import csi_pb2 as csi__pb2\n"
    if plain not in text:
        raise SystemExit(f"unexpected protoc output in {grpc_module}: no {plain.strip()!r} to rewrite")
    grpc_module.write_text(text.replace(plain, f"from {PACKAGE} import csi_pb2 as csi__pb2\n"))
    return [out / name for name in OUTPUTS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the stubs")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
