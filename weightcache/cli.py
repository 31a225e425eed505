"""The `weightcache` command. Thin: parses arguments, calls public APIs, prints, maps errors to exit codes.

Exit codes: each error declares its own (weightcache/errors.py lists them all).
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import weightcache
from weightcache import defaults
from weightcache.cli_backends import DaemonCache, StoreCache, match, open_cache
from weightcache.errors import (
    ConfigError,
    InvalidReferenceError,
    NotCachedError,
    WeightcacheError,
    answer_for,
)
from weightcache.progress import Progress, ProgressWire
from weightcache.redact import redact
from weightcache.units import fmt_bytes, parse_size

# Imported where used: a prefetch through the daemon (the node's cache hits and small models) imports neither
# logging (with traceback, linecache, tokenize: 5-9 ms) nor threading, nor the fetch settings
# (weightcache/settings.py, 3-4 ms more) unless one of their flags is given
# (tests/test_cli_daemon.py::test_a_hit_through_the_daemon_imports_no_store).
if TYPE_CHECKING:  # imported lazily at run time: `weightcache --help` stays fast
    from weightcache.daemon.client import DaemonClient
    from weightcache.store import Store
    from weightcache.uri import ModelRef

# -- helpers ----------------------------------------------------------------------------------------------------
def _root(args: argparse.Namespace) -> str:
    return str(args.root or defaults.root())


def _floor(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """The free-space floor this command sets: --min-free-bytes/--min-free-percent, else the daemon's env
    variables, else None (the store's own, kept by whoever set it: store/floor.py, else the defaults)."""
    from weightcache.store.floor import floor_from

    return floor_from(os.environ, min_free_bytes=args.min_free_bytes, min_free_percent=args.min_free_percent)


def _store(args: argparse.Namespace, *, budget: int | None = None) -> Store:
    """The store itself, created if missing: for a direct prefetch only (every other command: `_cache`). A
    `budget` (or floor) given is kept with the store; none: the store's own."""
    from weightcache.store.store import UNSET, Store

    min_free_bytes, min_free_percent = _floor(args)
    return Store(_root(args), budget_bytes=UNSET if budget is None else budget, min_free_bytes=min_free_bytes,
                 min_free_percent=min_free_percent)


def _cache(args: argparse.Namespace) -> DaemonCache | StoreCache:
    """The node daemon when its socket answers (and no --root or --no-daemon), else the store at the root."""
    return open_cache(args.root, defaults.root(), args.socket or defaults.socket(), use_daemon=not args.no_daemon,
                      endpoint_url=args.endpoint_url, floor=lambda: _floor(args))


def _say(args: argparse.Namespace, text: str) -> None:
    """A line for people on stdout, unless --quiet."""
    if not args.quiet:
        print(text)


def size_arg(text: str) -> int:
    """A size flag: a Kubernetes quantity (weightcache.units), with the grammar's own message on a bad one."""
    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("size: ")) from None


def percent_arg(text: str) -> float:
    """A share-of-disk flag (0 to 90), with the same message as the config file's."""
    from weightcache.store.floor import parse_percent

    try:
        return parse_percent(text, "percent")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("percent: ")) from None


class ProgressPrinter:
    """A progress bar on a terminal; JSON lines otherwise (stderr, so stdout keeps the result).

    The bar redraws in place with `\r`, so each draw erases what a longer previous draw left to its right
    ("downloadingg"), and is cut to the terminal's width: a line that wraps cannot be redrawn by `\r` at all.
    """

    CLEAR_TO_EOL = "\x1b[K"  # ANSI erase-in-line, understood by every terminal emulator in use

    def __init__(self, out: TextIO = sys.stderr, *, quiet: bool = False) -> None:
        self.out = out
        self.tty = out.isatty()
        self.quiet = quiet
        self._last = 0.0
        self._shown = 0  # width of the line on screen, padded over as well where ANSI is not understood

    def __call__(self, p: Progress) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if now - self._last < (0.1 if self.tty else 1.0) and p.phase == "downloading":
            return
        self._last = now
        if not self.tty:
            self.out.write(json.dumps({"event": "progress", **p.to_wire()}) + "\n")  # to_wire redacts its texts
        else:
            self.out.write(self.redraw(self.bar(p)))
        self.out.flush()

    @staticmethod
    def bar(p: Progress) -> str:
        frac = p.bytes_done / p.bytes_total if p.bytes_total else 0.0
        eta = f" ETA {p.eta:.0f}s" if p.eta is not None and p.phase == "downloading" else ""
        return (f"[{'#' * int(frac * 30):<30}] {frac * 100:5.1f}% {fmt_bytes(p.bytes_done)}/{fmt_bytes(p.bytes_total)}"
                f" {fmt_bytes(p.rate)}/s{eta} files {p.files_done}/{p.files_total} {p.phase}")

    def redraw(self, line: str) -> str:
        """What to write so that the terminal's current line shows exactly `line`."""
        width = shutil.get_terminal_size((80, 24)).columns - 1  # the last column would wrap on some terminals
        line = line[:max(width, 20)]
        pad = " " * max(0, self._shown - len(line))
        self._shown = len(line)
        return f"\r{line}{pad}{self.CLEAR_TO_EOL}"

    def close(self) -> None:
        if self.tty and not self.quiet and self._last:
            self.out.write("\n")


def _print_table(rows: list[list[str]], headers: list[str], out: TextIO | None = None) -> None:
    out = out or sys.stdout  # at call time: a default bound at import would miss a redirected stdout
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _bandwidth_line(bandwidth: Any) -> str:
    """`weightcache status`'s line of the daemon's bytesPerSecond: each limit in force, then whether a reload
    changes them."""
    if not isinstance(bandwidth, dict):
        return "?"
    sources = bandwidth.get("sources")
    rates = {"origin": bandwidth.get("origin"), "peers": bandwidth.get("peers"), "serve": bandwidth.get("serve"),
             **(sources if isinstance(sources, dict) else {})}
    shown = [f"{k} {fmt_bytes(v)}/s" for k, v in rates.items() if isinstance(v, int) and v > 0]
    live = "live (a config reload applies it)" if bandwidth.get("live") else "changed by a restart only"
    return f"{', '.join(shown) or 'no limit (bytesPerSecond unset)'}; {live}"


def _ago(ts: float) -> str:
    d = max(0, time.time() - ts)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.0f}h ago"


# -- commands ---------------------------------------------------------------------------------------------------
def cmd_prefetch(args: argparse.Namespace) -> int:
    from weightcache.uri import parse_ref

    ref = parse_ref(args.ref, revision=args.revision, include=args.include, exclude=args.exclude)
    if args.cluster:
        _log_to_stderr(args)
        from weightcache.kube.client import load_api_client
        from weightcache.kube.cluster_cli import prefetch_cluster

        api = load_api_client()
        if api is None:
            raise ConfigError("--cluster needs a Kubernetes config (in-cluster or KUBECONFIG); none was found")
        selector = dict(kv.split("=", 1) for kv in args.node_selector)
        return prefetch_cluster(api, ref, name=args.name, node_selector=selector, tier=args.tier,
                                allowed_namespaces=args.allow_namespace, wait=args.wait, timeout=args.timeout,
                                out=sys.stdout, json_lines=args.output == "json" or not sys.stdout.isatty(),
                                size_bytes=_selected_bytes(args, ref), signature=_signature_spec(args))
    cache = _cache(args)
    if args.dry_run or not isinstance(cache, DaemonCache):  # this process reads the source: its libraries log
        _log_to_stderr(args)
    if args.dry_run:
        return _dry_run(args, ref, cache)
    printer = ProgressPrinter(quiet=args.quiet)
    if isinstance(cache, DaemonCache):
        _refuse_unsent(args, cache)
    try:
        if isinstance(cache, DaemonCache):
            result = _prefetch_through(cache.client, ref, args, printer)
        else:
            result = _prefetch_here(ref, args, printer)
    except _Stopped as stop:
        printer.close()
        print(stop, file=sys.stderr)
        return 130
    printer.close()
    if args.output == "json":
        print(json.dumps(result))
    elif args.quiet:
        print(result["path"])  # as `hf download --quiet`: only where the model is
    else:
        print(f"{ref}: snapshot {result['id'][:12]} at {result['path']} ({fmt_bytes(result['size'])})")
    return 0


class _Stopped(Exception):
    """Ctrl-C during a prefetch; the message says what happens to the download."""


#: The FetchSettings fields `prefetch` takes a flag for (weightcache/settings.py declares them: `fetch_flags`).
PREFETCH_FETCH_FLAGS = ("concurrency", "chunk_size", "connect_timeout", "read_timeout")
#: Flags of a fetch that the daemon's API does not take (those of the fetch settings, `FETCH_FLAGS`, and these):
#: its fetches run under its own config (endpoints, concurrency, timeouts), shared by every client that joins them.
UNSENT_FLAGS = (("endpoint_url", "--endpoint-url", "endpoints"), ("disk_budget", "--disk-budget", "diskBudget"),
                ("min_free_bytes", "--min-free-bytes", "minFreeBytes"),
                ("min_free_percent", "--min-free-percent", "minFreePercent"))


def _refuse_unsent(args: argparse.Namespace, cache: DaemonCache) -> None:
    """A flag the daemon would not honour is refused, never dropped (a fetch that went to AWS instead of the
    --endpoint-url given, while --no-daemon worked). The fetch settings' flags are named by weightcache/settings.py,
    imported only when one of them is given."""
    fetch: tuple[tuple[str, str, str], ...] = ()
    if any(getattr(args, attr, None) is not None for attr in PREFETCH_FETCH_FLAGS):
        from weightcache.settings import FETCH_FLAGS as fetch

    given = [(flag, key) for attr, flag, key in (*UNSENT_FLAGS, *fetch) if getattr(args, attr, None) is not None]
    if given:
        flags = ", ".join(flag for flag, _ in given)
        keys = ", ".join(f"`{key}`" for _, key in given)
        raise ConfigError(f"{flags}: {cache.where} fetches with its own settings and does not take "
                          f"{'this flag' if len(given) == 1 else 'these flags'}; set {keys} in its config "
                          "(docs/config.md), or fetch with this command's settings into a store of its own "
                          "with --no-daemon (or --root DIR)")


def _prefetch_through(client: DaemonClient, ref: ModelRef, args: argparse.Namespace,
                      printer: ProgressPrinter) -> dict[str, Any]:
    """Join the daemon's fetch. On Ctrl-C the daemon stops it unless someone else wants it: the last progress
    line said which (`kept`), so the message says plainly whether the download goes on."""
    kept = False

    def on_progress(wire: ProgressWire) -> None:
        nonlocal kept
        p = Progress.from_wire(wire)
        kept = p.kept
        printer(p)

    try:
        return client.ensure(ref.uri, revision=ref.revision, include=list(ref.include), exclude=list(ref.exclude),
                             tier=args.tier, pin=args.pin, signature=_signature_spec(args), on_progress=on_progress)
    except KeyboardInterrupt:
        if kept:
            raise _Stopped(f"stopped waiting; the daemon goes on fetching {ref} for another client, a pod or a "
                           "ModelCache that wants it (`weightcache ls` shows it once cached)") from None
        raise _Stopped(f"cancelled: the daemon stops fetching {ref}; the chunks it finished are kept and the next "
                       "prefetch resumes from them") from None


def _prefetch_here(ref: ModelRef, args: argparse.Namespace, printer: ProgressPrinter) -> dict[str, Any]:
    """Download into the store directly. Ctrl-C cancels the queued ranges at once; finished chunks and their
    journal stay for the next run."""
    import threading

    from weightcache.access import ADMIN, node_admin
    from weightcache.daemon.listing import snapshot_body
    from weightcache.settings import flags_from, load_fetch_settings
    from weightcache.signatures import parse_policy

    store = _store(args, budget=args.disk_budget)
    cancel = threading.Event()
    # the daemon's fetch settings (WEIGHTCACHE_CONFIG, WEIGHTCACHE_CONCURRENCY, ...), the flags over them
    fetcher = load_fetch_settings(flags=flags_from(args)).fetcher(store, ref, cancel=cancel)
    spec = _signature_spec(args)
    signed_by = None if spec is None else parse_policy(spec, source="--signed-by")
    try:
        snap = fetcher.ensure(node_admin(store.root).authorize(ref, ADMIN, signed_by=signed_by), progress=printer)
    except KeyboardInterrupt:
        cancel.set()
        fetcher.close()
        raise _Stopped(f"cancelled the download of {ref}; finished chunks are kept and the next prefetch resumes "
                       "from them") from None
    if args.pin:
        store.pin(snap.id)
    return dict(snapshot_body(snap))


def _signature_spec(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--signed-by KEY.pub`, `--signed-by-ca CA.pem`, `--certificate-identity`, `--allow-unsigned` as the
    `spec.signature` a ModelCache would carry (docs/signing.md); None when none is given. The files are read here,
    by the user who named them; the daemon gets their contents."""
    keys, cas = args.signed_by, args.signed_by_ca
    if not keys and not cas and not args.certificate_identity and not args.allow_unsigned:
        return None
    from weightcache.signatures import parse_policy

    texts = {}
    for path in (*keys, *cas):
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 20)
            texts[path] = data.decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--signed-by: cannot read {path}: {exc}") from None
    spec = {"publicKeys": [texts[p] for p in keys], "caCertificates": [texts[p] for p in cas],
            "certificateIdentities": list(args.certificate_identity), "allowUnsigned": args.allow_unsigned}
    parse_policy(spec, source="--signed-by")  # a bad key file is exit 2 here, before anything is asked of anyone
    return spec


def _selected_bytes(args: argparse.Namespace, ref: ModelRef) -> int | None:
    """The selected files' total, listed with this command's credentials, for the ModelCache's size annotation
    (DRA's fetchable devices need it, docs/dra.md); None, with a warning, when the source cannot be listed here."""
    from weightcache.settings import flags_from, load_fetch_settings
    from weightcache.sources import open_source

    try:
        fetch = load_fetch_settings(flags=flags_from(args))
        source = open_source(ref, endpoint_url=fetch.endpoint_for(ref), connect_timeout=fetch.connect_timeout,
                             read_timeout=fetch.read_timeout)
        try:
            return sum(o.size for o in source.list())
        finally:
            source.close()
    except WeightcacheError as exc:
        print(f"warning: no weightcache.io/size-bytes: listing {ref} here failed ({exc}); the nodes still fetch "
              "it, but DRA nodes do not offer it as a fetchable device", file=sys.stderr)
        return None


def _dry_run(args: argparse.Namespace, ref: ModelRef, cache: DaemonCache | StoreCache) -> int:
    """What a prefetch would fetch: the source's files after the globs, their sizes, and what is cached."""
    from weightcache.settings import flags_from, load_fetch_settings
    from weightcache.sources import open_source

    fetch = load_fetch_settings(flags=flags_from(args))
    source = open_source(ref, endpoint_url=fetch.endpoint_for(ref), connect_timeout=fetch.connect_timeout,
                         read_timeout=fetch.read_timeout)
    try:
        objects = source.list()
    finally:
        source.close()
    try:
        cached = match(cache.snapshots(), str(ref), where=cache.where)
    except NotCachedError:
        cached = []
    total = sum(o.size for o in objects)
    if args.output == "json":
        print(json.dumps({"uri": ref.uri, "revision": ref.revision, "bytes": total, "cached": [c["id"] for c in cached],
                          "files": [{"path": o.relpath, "size": o.size} for o in objects]}))
        return 0
    if not args.quiet:
        _print_table([[o.relpath, fmt_bytes(o.size)] for o in objects], ["FILE", "SIZE"])
    state = (f"cached as snapshot {', '.join(c['id'][:12] for c in cached)} in {cache.where}: a prefetch only checks "
             "the source for changes" if cached else f"not cached in {cache.where}: a prefetch downloads it all")
    print(f"{ref}: {len(objects)} files, {fmt_bytes(total)}; {state}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    models = _cache(args).snapshots()
    if args.output == "json":
        print(json.dumps(models, indent=1))
        return 0
    rows = [[", ".join(m.get("refs") or [m["uri"]]), m["id"][:12], fmt_bytes(m["size"]), _ago(m["last_used"]),
             "yes" if m.get("pinned") else "", ",".join(m.get("leases") or []),
             fmt_bytes(m["memory_bytes"]) if m.get("memory_bytes") else ""] for m in models]
    _print_table(rows, ["MODEL", "SNAPSHOT", "SIZE", "LAST USED", "PINNED", "LEASES", "MEMORY"])
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if args.to_size is not None:
        gone, used = cache.evict_to(args.to_size)
        if args.output == "json":
            print(json.dumps({"evicted": gone, "used_bytes": used}))
        else:
            _say(args, f"evicted {len(gone)} snapshot(s); {cache.where} now uses {fmt_bytes(used)}")
        return 0
    if not args.ref:
        raise InvalidReferenceError("give a model reference or snapshot id, or --to-size SIZE")
    evicted = []
    for entry in match(cache.snapshots(), args.ref, where=cache.where):
        cache.evict(entry["id"])
        evicted.append(entry["id"])
        if args.output != "json":
            _say(args, f"evicted {entry['uri']} snapshot {entry['id'][:12]}")
    if args.output == "json":
        print(json.dumps({"evicted": evicted}))
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    cache = _cache(args)
    done = []
    for entry in match(cache.snapshots(), args.ref, where=cache.where):
        if args.command == "pin":
            cache.pin(entry["id"])
        else:
            cache.unpin(entry["id"])
        done.append(entry["id"])
        if args.output != "json":
            _say(args, f"{args.command}ned {entry['uri']} snapshot {entry['id'][:12]}")
    if args.output == "json":
        print(json.dumps({f"{args.command}ned": done}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if isinstance(cache, DaemonCache) and args.repair:
        _refuse_unsent(args, cache)  # --endpoint-url: the daemon refetches from its own endpoints
    entries = match(cache.snapshots(), args.ref, where=cache.where) if args.ref else cache.snapshots()
    damaged = 0
    if args.output == "json":  # one document; the exit code still says whether damage is left
        results = [cache.verify(entry["id"], repair=args.repair) for entry in entries]
        left = sum(1 for r in results if r["damaged"] and not r["repaired"])
        print(json.dumps({"snapshots": results, "damaged_left": left}))
        return 7 if left else 0
    for entry in entries:
        result = cache.verify(entry["id"], repair=args.repair)
        if not result["damaged"]:
            _say(args, f"ok       {result['uri']} {entry['id'][:12]} ({result['files']} files"
                       f"{_checks_text(result.get('source_checks'))}{_signature_text(result.get('signature'))})")
            continue
        print(f"DAMAGED  {result['uri']} {entry['id'][:12]}: {', '.join(result['damaged'])}")
        for fixed in result["repaired"]:
            print(f"repaired {fixed['ref']} -> snapshot {fixed['snapshot'][:12]}")
        damaged += 0 if result["repaired"] else 1
    if damaged and not args.repair:
        print("run `weightcache verify --repair` to refetch damaged snapshots", file=sys.stderr)
    return 7 if damaged else 0


def _checks_text(checks: object) -> str:
    """`; checked against the source by md5-etag 5, none 1` for verify's line (a daemon before the record: "")."""
    if not isinstance(checks, dict) or not checks:
        return ""
    counts: dict[str, int] = {}
    for check in checks.values():
        counts[str(check)] = counts.get(str(check), 0) + 1
    return "; checked against the source by " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _signature_text(signature: object) -> str:
    """`; signed by key sha256:ab12... (model.sig 9f3e...)` for verify's line ("" when none was asked for)."""
    if not isinstance(signature, dict) or not signature:
        return ""
    if signature.get("method") == "unsigned":
        return "; unsigned (allowed)"
    return (f"; signed by {signature.get('method')} {str(signature.get('signer'))[:80]} "
            f"(model.sig {str(signature.get('bundle_sha256'))[:12]})")


def cmd_export(args: argparse.Namespace) -> int:
    """Push one cached snapshot to a registry as a ModelPack artifact (weightcache/sources/oci_export.py)."""
    from weightcache.access import ADMIN, node_admin
    from weightcache.cli_backends import StoreCache
    from weightcache.settings import flags_from, load_fetch_settings
    from weightcache.sources import SourceOptions
    from weightcache.sources.oci_export import export_snapshot
    from weightcache.uri import parse_ref

    target = parse_ref(args.target)
    cache = StoreCache(Path(_root(args)))  # the store's own files: read here, never through the daemon
    found = match(cache.snapshots(), args.ref, where=cache.where)
    if len(found) > 1:
        raise InvalidReferenceError(f"{args.ref!r} names {len(found)} cached snapshots "
                                    f"({', '.join(e['id'][:12] for e in found[:5])}); give one snapshot id")
    store = cache.open()
    snap = store.get(found[0]["id"])
    node_admin(store.root).authorize(parse_ref(snap.uri), ADMIN)  # the same decision a direct prefetch asks
    fetch = load_fetch_settings(flags=flags_from(args))
    done = export_snapshot(snap, target, SourceOptions(connect_timeout=fetch.connect_timeout,
                                                       read_timeout=fetch.read_timeout),
                           on_file=None if args.quiet or args.output == "json" else
                           lambda path, sent: print(f"{'pushed ' if sent else 'exists '} {path}"))
    body = {"snapshot": snap.id, "target": done.target, "digest": done.digest, "files": done.files,
            "size": done.size, "uploaded": done.uploaded, "skipped": done.skipped}
    if args.output == "json":
        print(json.dumps(body))
    elif args.quiet:
        print(f"{done.target.rpartition(':')[0]}@{done.digest}")
    else:
        print(f"{snap.uri} snapshot {snap.id[:12]} -> {done.target} ({done.digest}; {done.files} files, "
              f"{fmt_bytes(done.size)}, {done.uploaded} blobs sent, {done.skipped} already there)")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    report = _cache(args).gc()
    if args.output == "json":
        print(json.dumps(report))
    else:
        _say(args, gc_text(report))
    return 0


def gc_text(r: dict[str, Any]) -> str:
    """What gc removed and why, in words: garbage apart from evictions for the floor."""
    garbage = (f"{fmt_bytes(r['unreferenced_blobs_bytes'])} of unreferenced blobs, {fmt_bytes(r['partial_bytes'])} "
               f"of abandoned partial downloads, {fmt_bytes(r['quarantine_bytes'])} of old quarantine")
    text = f"freed {fmt_bytes(r['freed_bytes'])}: {garbage}"
    if r["evicted"]:
        text += (f"; evicted {len(r['evicted'])} snapshot(s) ({', '.join(i[:12] for i in r['evicted'])}; "
                 f"{fmt_bytes(r['evicted_bytes'])}) because the disk had less free than the store's floor of "
                 f"{fmt_bytes(r['floor_bytes'])}")
    if r["free_bytes"] < r["floor_bytes"]:
        text += (f"; the disk still has only {fmt_bytes(r['free_bytes'])} free, under the floor of "
                 f"{fmt_bytes(r['floor_bytes'])}: the rest is pinned or leased (`weightcache ls`), or not the "
                 "store's (another writer filled the disk)")
    return text


def cmd_uninstall_node(args: argparse.Namespace) -> int:
    from weightcache.kube.client import load_api_client
    from weightcache.settings import node_name
    from weightcache.uninstall import uninstall

    api = load_api_client()
    report = uninstall(Path(_root(args)), Path(args.kubelet_dir), Path(args.cdi_dir), Path(args.run_dir),
                       yes=args.yes, force=args.force, api_client=api, node=node_name() if api else None)
    if args.output == "json":
        print(json.dumps(report.as_json()))
        return 0
    verb = "removed" if report.applied else "would remove"
    for item in report.removed:
        print(f"{verb} {item.path}: {item.what}")
    if report.labels:
        print(f"{verb} labels of node {report.node}: {', '.join(report.labels)}")
    if not report.removed and not report.labels:
        print("nothing of weightcache found on this node")
    for note in report.notes:
        print(note)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from weightcache.kube.client import load_api_client

    api = load_api_client() if not args.root else None
    if api is not None:
        from weightcache.kube.cluster_cli import status

        return status(api, args.name, out=sys.stdout, output=args.output)
    cache = _cache(args)
    models = cache.snapshots()  # read-only: no store is created where none is
    summary: dict[str, Any] = {"where": cache.where, "snapshots": len(models),
                               "size_bytes": sum(m["size"] for m in models),
                               "leases": sum(len(m.get("leases") or []) for m in models),
                               "pinned": sum(1 for m in models if m.get("pinned"))}
    if isinstance(cache, DaemonCache):  # where the daemon's bytes came from (fleet fill: docs/peers.md)
        fetched = cache.fetched_bytes()
        summary.update(origin_bytes=int(fetched["origin"]), peer_bytes=int(fetched["peers"]))
        if (answer := cache.client.status()) is not None:  # the limits the daemon enforces now (bytesPerSecond)
            summary["bandwidth"] = answer.get("bandwidth")
    if args.output == "json":
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            if k == "bandwidth":
                v = _bandwidth_line(v)
            print(f"{k:<13} {fmt_bytes(v) if k.endswith('bytes') and v is not None else v}")
    return 0


def cmd_engine_cache(args: argparse.Namespace) -> int:
    """`engine-cache put NAME DIR --model REF`, `get NAME --model REF`, `list`, `fill NAME --model REF --snapshot
    ID` (from a peer): through the daemon, which computes the key from the snapshot it serves
    (docs/engine-caches.md); there is no store-direct way."""
    from weightcache.daemon.client import DaemonClient, DaemonError

    socket = args.socket or defaults.socket()
    client = DaemonClient(socket)
    model: dict[str, Any] = {"uri": args.model, "revision": args.revision, "include": args.include,
                             "exclude": args.exclude, "namespace": args.namespace}
    if args.action != "list" and (not args.name or not args.model):
        raise InvalidReferenceError(f"engine-cache {args.action} needs NAME and --model, as in weightcache "
                                    f"engine-cache {args.action} vllm-0.32.0-cpu"
                                    f"{' DIR' if args.action == 'put' else ''} --model s3://models/llama-3-8b/")
    if args.action == "fill" and not args.snapshot:
        raise InvalidReferenceError("engine-cache fill needs --snapshot ID, the id put printed on the node that holds "
                                    "the cache (weightcache engine-cache list there)")
    if args.action == "put" and not args.directory:
        raise InvalidReferenceError("engine-cache put needs the cache directory, as in weightcache engine-cache put "
                                    "vllm-0.32.0-cpu ~/.cache/vllm --model s3://models/llama-3-8b/")
    try:
        if args.action == "list":
            caches = client.engine_caches(namespace=args.namespace)
        elif args.action == "get":
            caches = [client.engine_cache(args.name, model)]
        elif args.action == "fill":
            caches = [client.fill_engine_cache(args.name, model, args.snapshot)]
        else:
            if not os.path.isdir(args.directory):
                raise InvalidReferenceError(f"{args.directory} is not a directory; give the engine's cache root "
                                            "(vLLM: VLLM_CACHE_ROOT, default ~/.cache/vllm)")
            caches = [client.put_engine_cache(args.name, model, args.directory)]
    except (ConnectionError, FileNotFoundError) as exc:
        raise DaemonError(f"no daemon answers on {socket} ({exc}); engine caches are kept by the node's daemon: "
                          "start it (weightcache daemon) or pass --socket", code="unavailable", status=503) from None
    if args.output == "json":
        print(json.dumps(caches if args.action == "list" else caches[0], indent=1))
        return 0
    if args.action == "get":
        print(caches[0]["path"])
        return 0
    rows = [[c["key"], c["model_snapshot"][:12], c.get("domain", ""), c["snapshot"]["id"][:12],
             fmt_bytes(c["snapshot"]["size"]), str(c["snapshot"]["files"]),
             _ago(c["last_used"]) if "last_used" in c else "just now"] for c in caches]
    _print_table(rows, ["ENGINE", "MODEL SNAPSHOT", "DOMAIN", "SNAPSHOT", "SIZE", "FILES", "LAST USED"])
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    """What runs here: the package version (pyproject.toml's, read back from the installed metadata), Python, the
    platform, and the versions of the store's on-disk formats (a store written by another release may differ)."""
    import platform

    from weightcache.store.index import SCHEMA_VERSION
    from weightcache.store.records import MANIFEST_VERSION

    info: dict[str, Any] = {"version": weightcache.__version__, "python": platform.python_version(),
                            "implementation": platform.python_implementation(), "platform": platform.platform(),
                            "store_format": {"manifest": MANIFEST_VERSION, "index_schema": SCHEMA_VERSION}}
    if args.output == "json":
        print(json.dumps(info))
    else:
        print(f"weightcache {info['version']}")
        print(f"python      {info['implementation']} {info['python']}")
        print(f"platform    {info['platform']}")
        print(f"store       manifest v{MANIFEST_VERSION}, index schema v{SCHEMA_VERSION}")
    return 0


# -- parser -----------------------------------------------------------------------------------------------------
def _fetch_flags(attrs: tuple[str, ...]) -> Callable[[argparse.ArgumentParser], None]:
    def declare(parser: argparse.ArgumentParser) -> None:
        from weightcache.settings import fetch_flags

        fetch_flags(parser, *attrs, described=False)
    return declare


def _describe_fetch_flags(attrs: tuple[str, ...]) -> Callable[[argparse.ArgumentParser], None]:
    def describe(parser: argparse.ArgumentParser) -> None:
        from weightcache.settings import describe_fetch_flags

        describe_fetch_flags(parser, *attrs)
    return describe


def _output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table",
                        help="table for people (default) or one JSON document for scripts")


class CommandParser(argparse.ArgumentParser):
    """A command's parser that may declare some flags only once it parses or shows its help or usage (`declare`):
    those made from the settings' definitions (weightcache/settings.py, `weightcache daemon`'s from its config) cost
    their imports and docstrings, which every other command starts without.

    `skippable`: flags whose absence reads as not given (None, `getattr(args, attr, None)`). A command line whose
    every option is one the parser has, spelled whole, then parses without them (what they would add cannot change
    how it parses: an option spelled whole is never read as another) and they stay undeclared: a prefetch through
    the daemon without them never imports the settings (3-4 ms, and logging with them)."""

    def __init__(self, *args: Any, declare: Callable[[argparse.ArgumentParser], None] | None = None,
                 describe: Callable[[argparse.ArgumentParser], None] | None = None, skippable: bool = False,
                 **kwargs: Any) -> None:
        """`describe`: writes the help of what `declare` declared without it, once help is shown."""
        super().__init__(*args, **kwargs)
        self._declare, self._describe, self._skippable = declare, describe, skippable

    def _declared(self) -> None:
        declare, self._declare = self._declare, None
        if declare is not None:
            declare(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if not self._skippable or not self._spelled_whole(sys.argv[1:] if args is None else list(args)):
            self._declared()
        return super().parse_known_args(args, namespace)

    def _spelled_whole(self, argv: list[str]) -> bool:
        """Every option in `argv` is one this parser has, spelled whole (alone or with `=VALUE`); anything
        else (an abbreviation, a flag still to declare, a cluster of short flags, a value that looks like an
        option) and the flags are declared first, as they always were."""
        for arg in argv:
            if arg == "--":  # the rest are positionals
                return True
            if len(arg) > 1 and arg[0] in self.prefix_chars and arg not in self._option_string_actions \
                    and arg.split("=", 1)[0] not in self._option_string_actions:
                return False
        return True

    def format_usage(self) -> str:  # a usage error's message lists every flag, as it always did
        self._declared()
        return super().format_usage()

    def format_help(self) -> str:
        self._declared()
        describe, self._describe = self._describe, None
        if describe is not None:
            describe(self)
        return super().format_help()


class _Version(argparse.Action):
    """--version, reading the version only when asked: importlib.metadata is not loaded by every command."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"weightcache {weightcache.__version__}")  # to stdout, as argparse's own version action
        parser.exit()


#: The commands build_parser defines itself (the daemon's and the webhook's come from their modules).
COMMANDS = frozenset({"prefetch", "ls", "evict", "pin", "unpin", "verify", "gc", "export", "push", "status",
                      "engine-cache", "uninstall-node", "version"})


def command_named(argv: list[str]) -> str | None:
    """The command of COMMANDS that `argv` runs, where nothing before it but --log-level and its value (the
    top-level flag that takes one, abbreviated or not) could make argparse read it otherwise; else None."""
    at = 0
    while at < len(argv) and len(name := argv[at].split("=", 1)[0]) > 2 and "--log-level".startswith(name):
        at += 1 if "=" in argv[at] else 2
    return argv[at] if at < len(argv) and argv[at] in COMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or with `only` (one of COMMANDS, from `command_named`) that command's alone:
    argparse's parsers cost their construction (gettext looking for translations on disk three times each,
    the terminal's size asked for each flag), 7-14 ms for all of them, of a prefetch that otherwise spends
    about 10 ms in Python once its modules are imported."""
    parser = argparse.ArgumentParser(prog="weightcache", description="Node-local model weight cache.")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    parser.add_argument("--log-level", default=os.environ.get("WEIGHTCACHE_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)

    def wanted(*names: str) -> bool:
        return only is None or only in names

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str, *, writes: bool = False,
            quiet: str | None = "no chatter: errors, and what was asked for",
            aliases: list[str] | None = None, fetch: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """A store command with the flags it uses and no others: every one finds the store (--root, --socket,
        --no-daemon) and prints (-o); those that write the store take the free-space floor (`writes`); those
        that say what they did take -q (`quiet`: what is still printed); those that fetch take the fetch
        settings' flags named in `fetch` (weightcache/settings.py)."""
        p = sub.add_parser(name, help=help_, description=help_[:1].upper() + help_[1:] + ".", aliases=aliases or [],
                           declare=_fetch_flags(fetch) if fetch else None,
                           describe=_describe_fetch_flags(fetch) if fetch else None, skippable=True)
        p.set_defaults(func=func, quiet=False, min_free_bytes=None, min_free_percent=None, endpoint_url=None)
        p.add_argument("--root", help=f"store root (env WEIGHTCACHE_ROOT, default {defaults.ROOT}); "
                                      "given explicitly, the CLI uses the store directly, not the daemon")
        _output(p)
        p.add_argument("--socket", help=f"daemon socket (env WEIGHTCACHE_SOCKET, default {defaults.SOCKET})")
        p.add_argument("--no-daemon", action="store_true", help="use the store directly even if a daemon runs")
        if writes:
            p.add_argument("--min-free-bytes", type=size_arg, default=None, metavar="SIZE",
                           help="keep at least this much of the store's filesystem free, used directly (env "
                                f"WEIGHTCACHE_MIN_FREE_BYTES, default {fmt_bytes(defaults.MIN_FREE_BYTES)})")
            p.add_argument("--min-free-percent", type=percent_arg, default=None, metavar="PERCENT",
                           help="keep at least this share of it free, the larger of the two wins (env "
                                f"WEIGHTCACHE_MIN_FREE_PERCENT, default {defaults.MIN_FREE_PERCENT:g})")
        if quiet is not None:
            p.add_argument("-q", "--quiet", action="store_true", help=quiet)
        return p

    if wanted("prefetch"):
        p = add("prefetch", cmd_prefetch, "fetch a model into the node store (or across a cluster with --cluster)",
                writes=True, quiet="no progress and no chatter: errors, and the snapshot path",
                fetch=PREFETCH_FETCH_FLAGS)
        p.add_argument("ref", help="model reference, e.g. s3://models/llama-3-8b/[@revision]")
        p.add_argument("--revision")
        p.add_argument("--include", action="append", default=[], metavar="GLOB")
        p.add_argument("--exclude", action="append", default=[], metavar="GLOB")
        p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
        p.add_argument("--disk-budget", type=size_arg, default=None, help="evict LRU models to stay under this size")
        p.add_argument("--tier", choices=["disk", "memory"], default="disk")
        p.add_argument("--pin", action="store_true", help="never evict this model")
        p.add_argument("--dry-run", action="store_true", help="list what would be fetched (files, sizes) and what "
                                                              "is already cached; download nothing")
        p.add_argument("--signed-by", action="append", default=[], metavar="KEY.pub",
                       help="require a model.sig signed by this EC public key (repeat: any one of them); a missing or "
                            "failed signature is exit 7 and nothing is published (docs/signing.md)")
        p.add_argument("--signed-by-ca", action="append", default=[], metavar="CA.pem",
                       help="require a model.sig signed with a certificate that chains to this CA certificate")
        p.add_argument("--certificate-identity", action="append", default=[], metavar="ID",
                       help="with --signed-by-ca: the signing certificate's email, URI or DNS name must be one of "
                            "these")
        p.add_argument("--allow-unsigned", action="store_true",
                       help="with --signed-by: a model without model.sig is published (recorded unsigned)")
        p.add_argument("--cluster", action="store_true", help="declare a ModelCache so matching nodes prefetch it")
        p.add_argument("--node-selector", action="append", default=[], metavar="K=V")
        p.add_argument("--allow-namespace", action="append", default=[], metavar="NS",
                       help="namespace whose pods may mount the model ('*' for all); with --cluster")
        p.add_argument("--name", help="ModelCache name (default: derived from the reference)")
        p.add_argument("--wait", action="store_true", help="with --cluster: wait until every selected node is ready")
        p.add_argument("--timeout", type=float, default=3600.0)

    if wanted("ls"):
        add("ls", cmd_ls, "list cached models", quiet=None)
    if wanted("evict"):
        p = add("evict", cmd_evict, "remove a cached model (refused while pods use it or it is pinned)", writes=True)
        p.add_argument("ref", nargs="?", help="reference, snapshot id or id prefix")
        p.add_argument("--to-size", type=size_arg, help="evict least recently used models until the store fits")
    if wanted("pin", "unpin"):
        for name in ("pin", "unpin"):
            p = add(name, cmd_pin, f"{name} a cached model")
            p.add_argument("ref")
    if wanted("verify"):
        p = add("verify", cmd_verify, "re-hash cached models; --repair refetches damaged ones", writes=True)
        p.add_argument("ref", nargs="?")
        p.add_argument("--repair", action="store_true", help="refetch damaged snapshots from their source")
        p.add_argument("--endpoint-url", default=None,
                       help="S3 endpoint for --repair (default: AWS_ENDPOINT_URL or AWS)")
    if wanted("gc"):
        add("gc", cmd_gc, "remove unreferenced blobs and abandoned partial downloads", writes=True)
    if wanted("export", "push"):
        p = add("export", cmd_export, "push a cached snapshot to a registry as a ModelPack artifact (oci://)",
                quiet="no chatter: errors, and the pushed reference by digest", aliases=["push"],
                fetch=("connect_timeout", "read_timeout"))
        p.add_argument("ref", help="the cached model: a reference, snapshot id or id prefix")
        p.add_argument("target", help="oci://REGISTRY[:PORT]/REPOSITORY[:TAG] (default tag latest)")
    if wanted("status"):
        p = add("status", cmd_status, "per-node state of ModelCaches (cluster), or this store's summary", quiet=None)
        p.add_argument("name", nargs="?")

    if wanted("engine-cache"):
        p = sub.add_parser("engine-cache", help="an engine's compile cache on this node: put DIR, get its path, "
                           "list, fill from a peer",
                           description="Engine compile caches kept by the node's daemon, keyed by the model snapshot "
                           "it serves, ENGINE-VERSION-DEVICE and the namespace (docs/engine-caches.md).")
        p.set_defaults(func=cmd_engine_cache)
        p.add_argument("action", choices=["put", "get", "list", "fill"])
        p.add_argument("name", nargs="?", help="ENGINE-VERSION-DEVICE, e.g. vllm-0.32.0-cpu")
        p.add_argument("directory", nargs="?", help="put: the engine's cache root (vLLM: VLLM_CACHE_ROOT)")
        p.add_argument("--model", help="the model the cache was compiled for, e.g. s3://models/llama-3-8b/")
        p.add_argument("--revision")
        p.add_argument("--include", action="append", default=[], metavar="GLOB")
        p.add_argument("--exclude", action="append", default=[], metavar="GLOB")
        p.add_argument("--namespace", help="put: the trust domain (default: the admin's, served to every namespace "
                                           "granted the model); get, list: what that namespace is served")
        p.add_argument("--snapshot", help="fill: the cache's snapshot id on the node that has it; the peers' bytes "
                                          "must digest to it")
        p.add_argument("--socket", help=f"daemon socket (env WEIGHTCACHE_SOCKET, default {defaults.SOCKET})")
        _output(p)

    if wanted("uninstall-node"):
        p = sub.add_parser("uninstall-node", help="remove weightcache from this node: store, plugin sockets, CDI "
                           "specs, readiness labels", description="Remove what weightcache left on this node (the "
                           "store, the CSI and DRA sockets, the DRA CDI specs, this node's readiness labels); without "
                           "--yes, say what.")
        p.set_defaults(func=cmd_uninstall_node)
        p.add_argument("--root", default=None, help=f"store root (env WEIGHTCACHE_ROOT, default {defaults.ROOT})")
        p.add_argument("--kubelet-dir", default=str(defaults.KUBELET_DIR),
                       help=f"kubelet's root directory (default {defaults.KUBELET_DIR})")
        p.add_argument("--cdi-dir", default=str(defaults.CDI_DIR),
                       help=f"CDI spec directory (default {defaults.CDI_DIR})")
        p.add_argument("--run-dir", default=str(defaults.SOCKET.parent),
                       help=f"the daemon's socket directory (default {defaults.SOCKET.parent})")
        p.add_argument("--yes", action="store_true", help="remove; without it, only list what would be removed")
        p.add_argument("--force", action="store_true", help="remove even while a lease is held or the daemon runs")
        _output(p)

    if wanted("version"):
        p = sub.add_parser("version", help="version of weightcache, Python, platform and store formats",
                           description="Version of weightcache, Python, the platform and the store's on-disk formats.")
        p.set_defaults(func=cmd_version)
        _output(p)

    if only is not None:  # a command of this module: the others' modules are not imported
        return parser
    for module in ("weightcache.daemon.command", "weightcache.webhook.command"):
        try:
            mod = __import__(module, fromlist=["add_commands"])
        except ImportError as exc:  # a part not installed in this build
            import logging

            logging.getLogger("weightcache").debug("no %s: %s", module, exc)
            continue
        mod.add_commands(sub)
    return parser


def entry() -> NoReturn:
    """The `weightcache` command. After Ctrl-C (exit 130) it leaves without joining its fetch threads: one may sit in
    a read that the origin holds until the read timeout, and the interpreter joins every worker at exit. What they
    finished is journalled, so the next run resumes as it does after `kill -9`.

    With no thread but this one left, it leaves once the atexit handlers ran and its output is flushed, without the
    interpreter's teardown of every module and object (nothing of ours waits for it: files are written through
    descriptors and closed, the daemon's answer is read): 16 ms of a 0.13 s prefetch through the daemon, about a
    tenth of what the client costs a hit or a small model (docs/fetch.md)."""
    code = main()
    # threading is imported only by a command that may start threads: without it there is no other thread
    threading = sys.modules.get("threading")
    alone = threading is None or threading.active_count() == 1
    if alone:
        atexit._run_exitfuncs()  # logging's flush, weakref finalizers: what a normal exit runs
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        if code != 130:  # a reader that went away: the interpreter's own exit says so, as before
            raise SystemExit(code) from None
    if alone or code == 130:
        os._exit(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command_named(argv)).parse_args(argv)
    if args.func is not cmd_prefetch:  # prefetch does where it logs: not through the daemon (cmd_prefetch)
        _log_to_stderr(args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except WeightcacheError as exc:
        print(redact(f"error: {exc}"), file=sys.stderr)
        return answer_for(exc).exit_code
    except PermissionError as exc:
        print(redact(f"error: {exc}; run as root or point --root at a directory you own"), file=sys.stderr)
        return 1
    except OSError as exc:
        print(redact(f"error: {_os_error(exc, args)}"), file=sys.stderr)
        return 1


def _log_to_stderr(args: argparse.Namespace) -> None:
    """Log at --log-level to stderr, every line through `redact`, before anything that logs runs. Not done by a
    prefetch through the daemon: nothing on that path logs (nor imports logging, 5-9 ms of its start)."""
    import logging

    from weightcache.redact_logs import redact_log_handlers

    level = getattr(logging, str(args.log_level).upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_log_handlers()
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):  # their DEBUG logs carry Authorization headers
        logging.getLogger(noisy).setLevel(max(level, logging.INFO))
    for chatty in ("gcsfs", "adlfs", "azure"):  # they log each failure with its traceback, then raise it to us
        logging.getLogger(chatty).setLevel(level if level <= logging.DEBUG else logging.CRITICAL)


def _os_error(exc: OSError, args: argparse.Namespace) -> str:
    """An OS error in words that name the fix; the errno's own text stays at the end for searches."""
    where = exc.filename or getattr(args, "root", None) or defaults.root()
    if exc.errno == errno.EROFS:
        return (f"{where} is on a read-only filesystem, and the store writes its index and downloads there; "
                "point --root (or WEIGHTCACHE_ROOT) at a writable directory, or remount that filesystem "
                f"read-write ({exc.strerror})")
    if exc.errno == errno.ENOSPC:
        from weightcache.store.floor import full_disk_advice

        try:
            advice = full_disk_advice(where)
        except OSError:  # `where` is gone, or not a path
            advice = "free space on that filesystem, or point --root at a larger disk"
        return f"no space left on the filesystem of {where}; {advice} ({exc.strerror})"
    return str(exc)
