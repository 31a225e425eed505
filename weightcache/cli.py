"""The `weightcache` command. Thin: parses arguments, calls public APIs, prints, maps errors to exit codes.

Exit codes: each error declares its own (weightcache/errors.py lists them all).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from weightcache import __version__, defaults
from weightcache.errors import (
    ConfigError,
    InUseError,
    InvalidReferenceError,
    NotCachedError,
    WeightcacheError,
    answer_for,
)
from weightcache.progress import Progress
from weightcache.redact import redact, redact_log_handlers
from weightcache.units import fmt_bytes, parse_size

if TYPE_CHECKING:  # imported lazily at run time: `weightcache --help` stays fast
    from weightcache.daemon.client import DaemonClient
    from weightcache.store import Snapshot, Store

log = logging.getLogger("weightcache")

# -- helpers ----------------------------------------------------------------------------------------------------
def _root(args: argparse.Namespace) -> str:
    return str(args.root or defaults.root())


def _store(args: argparse.Namespace, *, budget: int | None = None) -> Store:
    from weightcache.store import Store

    return Store(_root(args), budget_bytes=budget)


def _daemon(args: argparse.Namespace) -> DaemonClient | None:
    """A client of the node daemon when its socket exists and no explicit --root asks for the store itself."""
    if args.root or getattr(args, "no_daemon", False):
        return None
    try:
        from weightcache.daemon.client import DaemonClient
    except ImportError:
        return None
    sock = Path(getattr(args, "socket", None) or defaults.socket())
    if not sock.exists():
        return None
    client = DaemonClient(sock)
    return client if client.available() else None  # a socket file left by a crash: use the store directly


def size_arg(text: str) -> int:
    """A size flag: a Kubernetes quantity (weightcache.units), with the grammar's own message on a bad one."""
    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None


class ProgressPrinter:
    """A progress bar on a terminal; JSON lines otherwise (stderr, so stdout keeps the result)."""

    def __init__(self, out: TextIO = sys.stderr) -> None:
        self.out = out
        self.tty = out.isatty()
        self._last = 0.0

    def __call__(self, p: Progress | dict[str, Any]) -> None:
        if isinstance(p, dict):
            p = Progress.from_json(p)
        now = time.monotonic()
        if now - self._last < (0.1 if self.tty else 1.0) and p.phase == "downloading":
            return
        self._last = now
        if not self.tty:
            self.out.write(json.dumps({"event": "progress", **p.to_json()}) + "\n")
        else:
            frac = p.bytes_done / p.bytes_total if p.bytes_total else 0.0
            bar = "#" * int(frac * 30)
            eta = f" ETA {p.eta:.0f}s" if p.eta is not None and p.phase == "downloading" else ""
            self.out.write(f"\r[{bar:<30}] {frac * 100:5.1f}% {fmt_bytes(p.bytes_done)}/{fmt_bytes(p.bytes_total)} "
                           f"{fmt_bytes(p.rate)}/s{eta} files {p.files_done}/{p.files_total} {p.phase:<11}")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")


def _print_table(rows: list[list[str]], headers: list[str], out: TextIO = sys.stdout) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _ago(ts: float) -> str:
    d = max(0, time.time() - ts)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.0f}h ago"


def _snapshot_json(snap: Any) -> dict[str, Any]:
    return {"id": snap.id, "path": str(snap.path), "uri": snap.uri, "revision": snap.revision, "size": snap.size,
            "files": len(snap.files)}


# -- commands ---------------------------------------------------------------------------------------------------
def cmd_prefetch(args: argparse.Namespace) -> int:
    from weightcache.uri import parse_ref

    ref = parse_ref(args.ref, revision=args.revision, include=args.include, exclude=args.exclude)
    if args.cluster:
        from weightcache.kube.client import load_api_client
        from weightcache.kube.cluster_cli import prefetch_cluster

        api = load_api_client()
        if api is None:
            raise ConfigError("--cluster needs a Kubernetes config (in-cluster or KUBECONFIG); none was found")
        selector = dict(kv.split("=", 1) for kv in args.node_selector)
        return prefetch_cluster(api, ref, name=args.name, node_selector=selector, tier=args.tier,
                                allowed_namespaces=args.allow_namespace, wait=args.wait, timeout=args.timeout,
                                out=sys.stdout, json_lines=not sys.stdout.isatty())
    printer = ProgressPrinter()
    client = _daemon(args)
    try:
        if client is not None:
            result = client.ensure(ref.uri, revision=ref.revision, include=list(ref.include),
                                   exclude=list(ref.exclude), tier=args.tier, pin=args.pin, on_progress=printer)
        else:
            from weightcache.fetch import Fetcher

            store = _store(args, budget=args.disk_budget)
            fetcher = Fetcher(store, concurrency=args.concurrency, chunk_size=args.chunk_size,
                              connect_timeout=args.connect_timeout, read_timeout=args.read_timeout,
                              endpoint_url=args.endpoint_url)
            snap = fetcher.ensure(ref, progress=printer)
            if args.pin:
                store.pin(snap.id)
            result = _snapshot_json(snap)
    finally:
        printer.close()
    if args.output == "json":
        print(json.dumps(result))
    else:
        print(f"{ref}: snapshot {result['id'][:12]} at {result['path']} ({fmt_bytes(result['size'])})")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    client = _daemon(args)
    if client is not None:
        models = client.list()
    else:
        models = [{"id": i.snapshot.id, "path": str(i.snapshot.path), "uri": i.snapshot.uri,
                   "refs": list(i.refs), "size": i.snapshot.size, "files": len(i.snapshot.files),
                   "last_used": i.last_used, "pinned": i.pinned, "leases": list(i.leases)}
                  for i in _store(args).list()]
    if args.output == "json":
        print(json.dumps(models, indent=1))
        return 0
    rows = [[", ".join(m.get("refs") or [m["uri"]]), m["id"][:12], fmt_bytes(m["size"]), _ago(m["last_used"]),
             "yes" if m.get("pinned") else "", ",".join(m.get("leases") or []),
             fmt_bytes(m["memory_bytes"]) if m.get("memory_bytes") else ""] for m in models]
    _print_table(rows, ["MODEL", "SNAPSHOT", "SIZE", "LAST USED", "PINNED", "LEASES", "MEMORY"])
    return 0


def _resolve(store: Store, text: str) -> list[Snapshot]:
    snaps = store.find(text)
    if not snaps:
        raise NotCachedError(f"nothing cached matches {text!r}; see `weightcache ls`")
    return snaps


def cmd_evict(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.to_size is not None:
        gone = store.evict_to(args.to_size)
        print(f"evicted {len(gone)} snapshot(s); store now uses {fmt_bytes(store.used_bytes())}")
        return 0
    if not args.ref:
        raise InvalidReferenceError("give a model reference or snapshot id, or --to-size SIZE")
    for snap in _resolve(store, args.ref):
        try:
            store.evict(snap.id)
        except InUseError as exc:
            from weightcache.csi import describe_holder

            held = [describe_holder(store.root, h) for h, s in store.leases().items() if s == snap.id]
            raise InUseError(f"{exc}" + (f". Held by: {'; '.join(held)}" if held else "")) from exc
        print(f"evicted {snap.uri} snapshot {snap.id[:12]}")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    store = _store(args)
    for snap in _resolve(store, args.ref):
        if args.command == "pin":
            store.pin(snap.id)
        else:
            store.unpin(snap.id, by="user")
        print(f"{args.command}ned {snap.uri} snapshot {snap.id[:12]}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from weightcache.store import drop_damaged, verify_snapshot

    store = _store(args)
    snaps = _resolve(store, args.ref) if args.ref else [i.snapshot for i in store.list()]
    damaged = 0
    for snap in snaps:
        bad = verify_snapshot(store, snap.id)
        if not bad:
            print(f"ok       {snap.uri} {snap.id[:12]} ({len(snap.files)} files)")
            continue
        damaged += 1
        print(f"DAMAGED  {snap.uri} {snap.id[:12]}: {', '.join(bad)}")
        if args.repair:
            from weightcache.fetch import Fetcher
            from weightcache.uri import parse_ref

            refs = drop_damaged(store, snap.id, bad)
            fetcher = Fetcher(store, endpoint_url=args.endpoint_url)
            for text in refs or [snap.uri]:
                new = fetcher.ensure(parse_ref(text))
                print(f"repaired {text} -> snapshot {new.id[:12]}")
                damaged -= 1 if text == (refs or [snap.uri])[0] else 0
    if damaged and not args.repair:
        print("run `weightcache verify --repair` to refetch damaged snapshots", file=sys.stderr)
    return 7 if damaged else 0


def cmd_gc(args: argparse.Namespace) -> int:
    from weightcache.store import collect_garbage

    freed = collect_garbage(_store(args))
    print(f"freed {fmt_bytes(freed)}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from weightcache.kube.client import load_api_client

    api = load_api_client() if not args.root else None
    if api is not None:
        from weightcache.kube.cluster_cli import status

        return status(api, args.name, out=sys.stdout, output=args.output)
    store = _store(args)
    infos = store.list()
    summary: dict[str, Any] = {"root": str(store.root), "snapshots": len(infos), "used_bytes": store.used_bytes(),
               "budget_bytes": store.budget_bytes, "leases": len(store.leases()),
               "pinned": sum(1 for i in infos if i.pinned)}
    if args.output == "json":
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:<13} {fmt_bytes(v) if k.endswith('bytes') and v is not None else v}")
    return 0


# -- parser -----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightcache", description="Node-local model weight cache.")
    parser.add_argument("--version", action="version", version=f"weightcache {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("WEIGHTCACHE_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.set_defaults(func=func)
        p.add_argument("--root", help=f"store root (env WEIGHTCACHE_ROOT, default {defaults.ROOT}); "
                                      "given explicitly, the CLI uses the store directly, not the daemon")
        p.add_argument("-o", "--output", choices=["table", "json"], default="table")
        return p

    p = add("prefetch", cmd_prefetch, "fetch a model into the node store (or across a cluster with --cluster)")
    p.add_argument("ref", help="model reference, e.g. s3://models/llama-3-8b/[@revision]")
    p.add_argument("--revision")
    p.add_argument("--include", action="append", default=[], metavar="GLOB")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB")
    p.add_argument("--concurrency", type=int, default=defaults.CONCURRENCY,
                   help=f"parallel ranged reads (default {defaults.CONCURRENCY})")
    p.add_argument("--chunk-size", type=size_arg, default=defaults.CHUNK_SIZE,
                   help="buffer per parallel read and the unit of resume; memory used is concurrency x chunk size; "
                        "each request asks for up to 256Mi (default 16Mi)")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--connect-timeout", type=float, default=defaults.CONNECT_TIMEOUT, metavar="SECONDS",
                   help=f"seconds to connect to the source (default {defaults.CONNECT_TIMEOUT:g})")
    p.add_argument("--read-timeout", type=float, default=defaults.READ_TIMEOUT, metavar="SECONDS",
                   help=f"seconds the source may stay silent before a retry (default {defaults.READ_TIMEOUT:g})")
    p.add_argument("--disk-budget", type=size_arg, default=None, help="evict LRU models to stay under this size")
    p.add_argument("--tier", choices=["disk", "memory"], default="disk")
    p.add_argument("--pin", action="store_true", help="never evict this model")
    p.add_argument("--no-daemon", action="store_true", help="use the store directly even if a daemon runs")
    p.add_argument("--socket", help="daemon socket (env WEIGHTCACHE_SOCKET)")
    p.add_argument("--cluster", action="store_true", help="declare a ModelCache so matching nodes prefetch it")
    p.add_argument("--node-selector", action="append", default=[], metavar="K=V")
    p.add_argument("--allow-namespace", action="append", default=[], metavar="NS",
                   help="namespace whose pods may mount the model ('*' for all); with --cluster")
    p.add_argument("--name", help="ModelCache name (default: derived from the reference)")
    p.add_argument("--wait", action="store_true", help="with --cluster: wait until every selected node is ready")
    p.add_argument("--timeout", type=float, default=3600.0)

    p = add("ls", cmd_ls, "list cached models")
    p.add_argument("--socket")
    p = add("evict", cmd_evict, "remove a cached model (refused while pods use it or it is pinned)")
    p.add_argument("ref", nargs="?", help="reference, snapshot id or id prefix")
    p.add_argument("--to-size", type=size_arg, help="evict least recently used models until the store fits")
    for name in ("pin", "unpin"):
        p = add(name, cmd_pin, f"{name} a cached model")
        p.add_argument("ref")
    p = add("verify", cmd_verify, "re-hash cached models; --repair refetches damaged ones")
    p.add_argument("ref", nargs="?")
    p.add_argument("--repair", action="store_true")
    p.add_argument("--endpoint-url", default=None)
    add("gc", cmd_gc, "remove unreferenced blobs and abandoned partial downloads")
    p = add("status", cmd_status, "per-node state of ModelCaches (cluster), or this store's summary")
    p.add_argument("name", nargs="?")

    for module in ("weightcache.daemon.command", "weightcache.webhook.command"):
        try:
            mod = __import__(module, fromlist=["add_commands"])
        except ImportError as exc:  # a part not installed in this build
            log.debug("no %s: %s", module, exc)
            continue
        mod.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_log_handlers()
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):  # their DEBUG logs carry Authorization headers
        logging.getLogger(noisy).setLevel(max(level, logging.INFO))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted; partial downloads are kept and resume on the next run", file=sys.stderr)
        return 130
    except WeightcacheError as exc:
        print(redact(f"error: {exc}"), file=sys.stderr)
        return answer_for(exc).exit_code
    except PermissionError as exc:
        print(redact(f"error: {exc}; run as root or point --root at a directory you own"), file=sys.stderr)
        return 1
    except OSError as exc:
        print(redact(f"error: {exc}"), file=sys.stderr)
        return 1
