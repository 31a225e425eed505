"""Micro-benchmark: CPU seconds per GiB to sha256 bytes that wait in the page cache (a range another worker
wrote), read back through `preadv` into a 1 MiB buffer (the fetch engine before), hashed through the mapping
download.py uses (`_mapped`: MAP_POPULATE, 8 MiB windows), and, as the floor, hashed from a 1 MiB buffer in the
core's cache. Rounds interleave the three, so a loaded machine charges them alike.

    .venv/bin/python scripts/bench_hash_reread.py [--mib 512] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import tempfile
from collections.abc import Callable

from weightcache.download import MAP_WINDOW, _mapped


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    size = args.mib << 20
    with tempfile.NamedTemporaryFile(dir=args.dir) as f:
        block = os.urandom(64 << 20)
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        fd = f.fileno()
        buf = memoryview(bytearray(1 << 20))

        def pread() -> None:
            h, pos = hashlib.sha256(), 0
            while pos < size:
                n = os.preadv(fd, [buf], pos)
                h.update(buf[:n])
                pos += n

        def mapped() -> None:
            h, pos = hashlib.sha256(), 0
            while pos < size:
                with _mapped(fd, pos, MAP_WINDOW) as view:
                    assert view is not None, "not resident: run with more free memory"
                    h.update(view)
                pos += MAP_WINDOW

        def in_cache() -> None:
            h = hashlib.sha256()
            for _ in range(size >> 20):
                h.update(buf)

        rows: dict[str, list[float]] = {}
        ways: list[tuple[str, Callable[[], None]]] = [("preadv into 1 MiB, hash", pread),
                                                      ("hash the mapping", mapped), ("hash a cached buffer", in_cache)]
        for _ in range(args.rounds):
            for name, fn in ways:
                start = cpu()
                fn()
                rows.setdefault(name, []).append((cpu() - start) * (1 << 30) / size)
    print(f"{'sha256 of page-cache bytes':<28} CPU s/GiB per round (load {os.getloadavg()[0]:.2f})")
    for name, got in rows.items():
        print(f"{name:<28} {' '.join(f'{x:.2f}' for x in got)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
