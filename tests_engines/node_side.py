"""The node's part of an engine test, run with the main venv's python (the daemon's modules, which .venv-engines
does not have): what the daemon would do for a pod, done by its own classes, held until stdin closes.

    python tests_engines/node_side.py hold STORE URI MODE [TMPFS_ROOT]
        The memory tier (weightcache/memory.py) makes the store's snapshot of URI resident in MODE (mlock: its
        pages locked in place; tmpfs: a locked copy, which pods then mount). Prints {"path": <what a pod reads>,
        "pid": ...}; stdin closed: demote, exit.
    python tests_engines/node_side.py stream SOURCE_DIR STORE VOLUME_ID
        A streaming volume's view (weightcache/csi/stream.py, as the CSI plugin fills it): a fresh store fetches
        file://SOURCE_DIR/ with a StreamFill subscribed, except that the hand-over of the last shard waits for a
        `release` line on stdin, so a pod's loader starts on a view that is still filling. Prints {"view": ...}
        at once, {"holding": <relpath>} when the last shard is verified and held, {"complete": true} once the
        snapshot is published and the view says so.
    python tests_engines/node_side.py report DIRECTORY ENGINE FIRST
        What the CSI plugin tells of the engine report at the root of DIRECTORY (weightcache/csi/telemetry.py, the
        code NodeGetVolumeStats runs on a pod's engine-cache volume), for a pod whose first publish was at FIRST
        (Unix seconds): prints {"events": [[reason, type, message], ...], "stages": [[stage, seconds], ...],
        "compile": [[engine, result], ...]}.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from weightcache.access import ADMIN, Authority
from weightcache.csi.stream import StreamFill
from weightcache.csi.telemetry import Pod, PodTelemetry
from weightcache.fetch import DurableFile, Fetcher
from weightcache.memory import MemoryTier
from weightcache.store import Store, StreamViews
from weightcache.uri import parse_ref


def say(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def hold(store: Path, uri: str, mode: str, tmpfs_root: str | None = None) -> None:
    snapshot = Store(store).lookup(parse_ref(uri))
    if snapshot is None:
        raise SystemExit(f"{uri} is not in the store {store}")
    tier = MemoryTier(snapshot.size + (16 << 20), mode=mode, tmpfs_root=Path(tmpfs_root) if tmpfs_root else None)
    tier.check_limits()
    tier.promote(snapshot)
    say({"path": str(tier.path_for(snapshot.id)), "locked_bytes": tier.locked_bytes()})
    sys.stdin.read()
    tier.close()


def stream(source: Path, store_root: Path, volume_id: str) -> None:
    grant = Authority().authorize(parse_ref(f"file://{source.resolve()}/"), ADMIN)
    store = Store(store_root)
    views = StreamViews(store.layout)
    say({"view": str(views.create(volume_id))})
    fill = StreamFill(views, volume_id, grant)
    last = sorted(p.name for p in source.glob("*.safetensors"))[-1]
    release = threading.Event()

    def on_file(durable: DurableFile) -> None:
        if durable.entry.path == last:
            say({"holding": last})
            release.wait()
        fill.on_file(durable)

    def released() -> None:
        for line in sys.stdin:
            if line.strip() == "release":
                release.set()
        release.set()  # stdin closed: let the fetch finish

    threading.Thread(target=released, daemon=True).start()
    snapshot = Fetcher(store).ensure(grant, on_file=on_file)
    say({"complete": fill.complete(snapshot)})


def report(directory: str, engine: str, first: float) -> None:
    told: dict[str, list[list[object]]] = {"events": [], "stages": [], "compile": []}
    telemetry = PodTelemetry(observe_stage=lambda stage, seconds, _: told["stages"].append([stage, seconds]),
                             pod_event=lambda _, reason, message, kind: told["events"].append([reason, kind, message]),
                             observe_compile=lambda name, result: told["compile"].append([name, result]))
    telemetry.engine_volume(Pod("ml", "pod", "uid"), engine, directory, first)
    say(told)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "hold":
        hold(Path(args[0]), args[1], args[2], args[3] if len(args) > 3 else None)
    elif command == "stream":
        stream(Path(args[0]), Path(args[1]), args[2])
    elif command == "report":
        report(args[0], args[1], float(args[2]))
    else:
        raise SystemExit(f"unknown command {command!r}: hold, stream or report")
