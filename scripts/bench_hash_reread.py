"""Micro-benchmark: CPU seconds per GiB to sha256 bytes that wait in the page cache (a range another worker
wrote), read back through `preadv` into a 1 MiB buffer (the fetch engine before issue 26), hashed through an 8 MiB
window mapped and unmapped each time (MAP_POPULATE: the engine before this round), hashed through the part
mapped once (download.py's `_PartMap`: mincore and MADV_POPULATE_READ per 8 MiB window), and, as the floor, hashed
from a 1 MiB buffer in the core's cache. Rounds interleave them, so a loaded machine charges them alike.

    .venv/bin/python scripts/bench_hash_reread.py [--mib 512] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import resource
import tempfile
from collections.abc import Callable

from weightcache.download import MAP_WINDOW, _PartMap


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

        def per_window() -> None:
            h, pos = hashlib.sha256(), 0
            while pos < size:
                mm = mmap.mmap(fd, MAP_WINDOW, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ, offset=pos)
                with mm, memoryview(mm) as view:
                    h.update(view)
                pos += MAP_WINDOW

        def once() -> None:
            h, pos, part = hashlib.sha256(), 0, _PartMap(fd, size)
            try:
                while pos < size:
                    view = part.resident(pos, MAP_WINDOW)
                    assert view is not None, "not resident: run with more free memory"
                    h.update(view)
                    view.release()
                    pos += MAP_WINDOW
            finally:
                part.close()

        def in_cache() -> None:
            h = hashlib.sha256()
            for _ in range(size >> 20):
                h.update(buf)

        rows: dict[str, list[float]] = {}
        ways: list[tuple[str, Callable[[], None]]] = [
            ("preadv into 1 MiB, hash", pread), ("map each 8 MiB window, hash", per_window),
            ("map once, hash windows", once), ("hash a cached buffer", in_cache)]
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
