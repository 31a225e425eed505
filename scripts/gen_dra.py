#!/usr/bin/env python3
"""Generate the DRA and plugin-registration gRPC stubs from dra/*.proto into weightcache/dra/_pb (or --out DIR).

    python scripts/gen_dra.py            # rewrite the committed stubs
    python scripts/gen_dra.py --out DIR  # write them elsewhere (the test compares the two byte for byte)

Same recipe as scripts/gen_csi.py: grpc_tools.protoc (pinned in pyproject, so the output is reproducible), then
each service module's `import X_pb2` is rewritten to the package-qualified import.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "dra"
PROTOS = ("dra_v1", "dra_v1beta1", "dra_health_v1alpha1", "pluginregistration")
DEFAULT_OUT = ROOT / "weightcache" / "dra" / "_pb"
PACKAGE = "weightcache.dra._pb"


def outputs(name: str) -> tuple[str, str, str]:
    return f"{name}_pb2.py", f"{name}_pb2.pyi", f"{name}_pb2_grpc.py"


def generate(out: Path) -> list[Path]:
    """Run protoc on every proto of dra/, writing three stub files each into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    written = []
    for name in PROTOS:
        argv = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={out}",
                f"--pyi_out={out}", f"--grpc_python_out={out}", f"{name}.proto"]
        if protoc.main(argv) != 0:
            raise SystemExit(f"protoc failed on {PROTO_DIR / name}.proto")
        grpc_module = out / f"{name}_pb2_grpc.py"
        text = grpc_module.read_text()
        alias = name.replace("_", "__")
        plain = f"import {name}_pb2 as {alias}__pb2\n"
        if plain not in text:
            raise SystemExit(f"unexpected protoc output in {grpc_module}: no {plain.strip()!r} to rewrite")
        grpc_module.write_text(text.replace(plain, f"from {PACKAGE} import {name}_pb2 as {alias}__pb2\n"))
        written += [out / f for f in outputs(name)]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the stubs")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
