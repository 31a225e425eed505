#!/usr/bin/env python3
"""CPU seconds per GB of each checksum a fetch may compute, by each implementation installed here.

    .venv/bin/python scripts/bench_checksums.py [--gib 0.5] [--runs 3]

1 MiB buffers (the fetch's piece), the best of --runs, CPU time of this process (robust on a shared machine).
weightcache uses hashlib's sha256 and MD5 and anycrc's CRCs (weightcache/checksums.py); zlib, awscrt, crc32c and
google-crc32c rows are there when installed, for the choice.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import os
import resource
import zlib
from collections.abc import Callable

Fn = Callable[[bytes], object]


def candidates() -> dict[str, Fn]:
    import anycrc

    out: dict[str, Fn] = {"sha256 (hashlib)": lambda b: hashlib.sha256(b), "md5 (hashlib)": lambda b: hashlib.md5(b)}
    for label, name in (("crc32", "CRC32-ISO-HDLC"), ("crc32c", "CRC32-ISCSI"), ("crc64nvme", "CRC64-NVME")):
        model = anycrc.Model(name)
        out[f"{label} (anycrc, weightcache)"] = lambda b, m=model: m.calc(b, 0)
    out["crc32 (zlib)"] = lambda b: zlib.crc32(b)
    optional: dict[str, tuple[str, Callable[[object], Fn]]] = {
        "crc32c (awscrt)": ("awscrt.checksums", lambda m: lambda b: m.crc32c(b)),  # type: ignore[attr-defined]
        "crc64nvme (awscrt)": ("awscrt.checksums", lambda m: lambda b: m.crc64nvme(b)),  # type: ignore[attr-defined]
        "crc32 (awscrt)": ("awscrt.checksums", lambda m: lambda b: m.crc32(b)),  # type: ignore[attr-defined]
        "crc32c (crc32c)": ("crc32c", lambda m: lambda b: m.crc32c(b)),  # type: ignore[attr-defined]
        "crc32c (google-crc32c)": ("google_crc32c", lambda m: lambda b: m.extend(0, b)),  # type: ignore[attr-defined]
    }
    for label, (module, make) in optional.items():
        with contextlib.suppress(ImportError):
            out[label] = make(importlib.import_module(module))
    return out


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5, help="bytes per run")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    buf = os.urandom(1 << 20)
    pieces = max(1, int(args.gib * 1024))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    print(f"{'checksum (implementation)':32s} {'CPU s/GB':>8s}")
    for label, fn in candidates().items():
        best = float("inf")
        for _ in range(args.runs):
            start = cpu()
            for _ in range(pieces):
                fn(buf)
            best = min(best, cpu() - start)
        print(f"{label:32s} {best / (pieces * len(buf) / 1e9):8.3f}")


if __name__ == "__main__":
    main()
