"""Benchmark: fleet fill as a deployment sees it. N real daemons, each in its own network namespace on a bridge,
every link limited with `tc` both ways, an S3 origin (moto) in its own namespace behind its own limit.

Root only (it makes namespaces, veth pairs, a bridge and tc qdiscs, and removes them all on exit, Ctrl-C included):

    sudo .venv/bin/python scripts/bench_fleet_netns.py [--nodes 16] [--model-mb 32] [--shards 4]
        [--origin-mbps 1] [--link-mbps 1] [--chunk-size 256Ki] [--json] [--keep-logs DIR] [--link-samples FILE]
        [--serve-share 0.88] [--faults] [--liar]

The defaults (16 nodes, 32 MB, 1 MB/s links, 256 KiB pieces) keep the links, not the 2 cores of a small machine,
the bottleneck: at 256 MB and 20 MB/s the 16 daemons needed more CPU than 2 cores have (docs/peers.md).

`--faults` (`fault_roles`): every third node killed -9 mid-fill, one cut off for a while, one asked late (from
N = 4), the origin answering 503 SlowDown for OUTAGE_S (a fault proxy, tests/faultproxy.py, in the origin's
namespace). `--liar`: n0 a lying peer (`make_liar`: it holds the model with one byte flipped in every piece);
the row adds `lies_caught` (each node's `that the origin contradicts` lines), split into the liar's pieces a node
used (found when their blob failed), took but judged before use, and digests it vouched for falsely.

The net (addresses in 10.77.0.0/16, bridge `wcfbr0`, namespaces `wcf-origin` and `wcf-n<i>`):

    wcf-origin: moto (python -m moto.server) on 10.77.0.2:5000; its veth egress is the origin's upload
    wcf-n<i>:   `python -m weightcache daemon` with peerListen 10.77.1.<i>:9479, the other nodes as static
                `peers`, one shared peerTokenFile, its own store root and API socket (a Unix socket: the bench
                reaches it from the host namespace)

Every veth end has a token bucket filter (`tc qdisc ... root tbf`): the end inside a namespace limits what the
namespace sends, the host end (a bridge port) what it receives. The model (safetensors shards, built here, each
uploaded with ChecksumAlgorithm=SHA256 so peers may serve it by digest) is uploaded before the origin's link is
limited. Each row: fresh namespaces and stores, every daemon started and answering, then every node asked for the
model at once (`PUT /v1/models?wait=1` on its socket); "one node alone" is the same with N = 1.

Printed per N: origin bytes / model (what the daemons counted as read from the origin, and the origin veth's
transmitted bytes with TCP/IP and HTTP overhead), each node's ready time, all ready / one node alone, daemon CPU
seconds during the fill and peak RSS (VmHWM) per node, and bytes each node's peer listener served. `--json`: one
object, the last N's summary (`nodes`, `origin_bytes_ratio`, `origin_egress_ratio`, `all_ready_ratio`,
`max_rss_mb`, `max_served_share`: the most a node served over the mean, `one_node_s`, `ready_s`,
`serve_limit_bytes_s`: each daemon's `bytesPerSecond.serve`, 0.88 of its link unless `--serve-share` says) and `rows`
with every N's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_prefetch import make_model
from weightcache.daemon.client import DaemonClient
from weightcache.units import parse_size

PY = sys.executable
# each daemon's bytesPerSecond.serve, a share of its link's rate: a peer server that fills the node's uplink queues
# the ACKs of what the node receives behind its bytes, and that node's download starved (docs/peers.md, "Serving
# below the uplink"; the payload of a full 1 MB/s link is ~0.95 MB/s)
SERVE_SHARE = 0.88
BRIDGE = "wcfbr0"
PREFIX = "wcf-"
ORIGIN_IP = "10.77.0.2"
HOST_IP = "10.77.0.1"
PEER_PORT = 9479
BUCKET = "fleet"
TOKEN = "bench-fleet-netns-token-0123456789abcdef"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def sh(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def node_ip(i: int) -> str:
    return f"10.77.{1 + i // 250}.{1 + i % 250}"


def limit(dev: str, mbps: float, ns: str | None = None) -> None:
    """A token bucket on `dev`'s egress: `mbps` MB/s, a 256 KiB burst, packets queued at most 100 ms."""
    pre = ("ip", "netns", "exec", ns) if ns else ()
    sh(*pre, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(mbps * 8e6)}bit",
       "burst", "256kb", "latency", "100ms")


def cut_off(dev: str, ns: str | None = None) -> None:
    """Every packet `dev` sends dropped (a FIFO that holds none): this VM's kernel has no netem (`loss 100%`)."""
    tc = ("ip", "netns", "exec", ns, "tc") if ns else ("tc",)
    sh(*tc, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")


def tx_bytes(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"))


NEIGH = Path("/proc/sys/net/ipv4/neigh/default")


def room_for_neighbours(nodes: int) -> dict[str, str]:
    """Raise the host's ARP table limits so that `nodes` namespaces fit, each holding an entry for every other node,
    the origin and the host; returns the old values (`Net.close` restores them). The kernel keeps one ARP table for
    every network namespace, 1,024 entries at most by default (`gc_thresh3`): at N = 32 the 32 x 33 entries
    overflowed it (dmesg: "neighbour: arp_cache: neighbor table overflow!"), and the nodes whose entries came last
    (n22-n31) could not reach each other: their HEADs timed out on connect 5 s each, one after another, or failed
    with no route to the host, and they began their own shares 16-63 s late (docs/peers.md, "The ARP table").
    A fleet of hosts has a table each."""
    need = (nodes + 2) ** 2
    old = {}
    for key, want in (("gc_thresh3", 4 * need), ("gc_thresh2", 2 * need), ("gc_thresh1", need)):
        old[key] = (NEIGH / key).read_text().strip()
        if int(old[key]) < want:
            (NEIGH / key).write_text(str(want))
    return old


class Net:
    """The bridge and every namespace made here; `close` removes them (also what an earlier run left)."""

    def __init__(self, nodes: int = 0) -> None:
        self.namespaces: list[str] = []
        self.cleanup()
        self._neigh = room_for_neighbours(nodes)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{HOST_IP}/16", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")

    def namespace(self, name: str, ip: str) -> str:
        """Namespace PREFIX+name with eth0 at `ip` on the bridge; the host end is wcfh-<name>."""
        ns, host_end = PREFIX + name, f"wcfh-{name}"
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host_end, "master", BRIDGE, "up")
        for cmd in (("ip", "addr", "add", f"{ip}/16", "dev", "eth0"), ("ip", "link", "set", "eth0", "up"),
                    ("ip", "link", "set", "lo", "up")):
            sh("ip", "netns", "exec", ns, *cmd)
        return ns

    link_mbps = 20.0  # the node links' rate (main sets it from --link-mbps)

    def limit_both(self, name: str, mbps: float) -> None:
        limit("eth0", mbps, PREFIX + name)  # what the namespace sends
        limit(f"wcfh-{name}", mbps)  # what it receives: the bridge port's egress

    def drop(self, name: str) -> None:
        ns = PREFIX + name
        sh("ip", "link", "del", f"wcfh-{name}", check=False)  # the pair goes with it; a namespace's own lags
        sh("ip", "netns", "del", ns, check=False)
        if ns in self.namespaces:
            self.namespaces.remove(ns)

    @staticmethod
    def cleanup() -> None:
        for ns in sh("ip", "netns", "list", check=False).split("\n"):
            if ns.startswith(PREFIX):
                sh("ip", "netns", "del", ns.split()[0], check=False)
        for line in sh("ip", "-o", "link", "show", check=False).splitlines():  # a namespace's removal lags
            dev = line.split(":")[1].strip().split("@")[0] if line.count(":") > 1 else ""
            if dev.startswith("wcfh-"):
                sh("ip", "link", "del", dev, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)

    def close(self) -> None:
        for ns in list(self.namespaces):
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        sh("ip", "link", "del", BRIDGE, check=False)
        for key in ("gc_thresh1", "gc_thresh2", "gc_thresh3"):  # lowest first: each stays below the next
            (NEIGH / key).write_text(self._neigh[key])


@dataclass
class Daemon:
    index: int
    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path
    cpu_before: float = 0.0
    sys_before: float = 0.0
    ready_s: float = 0.0
    error: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    moved: list[float] = field(default_factory=list)  # --faults: cut_moves

    def client(self) -> DaemonClient:
        return DaemonClient(self.socket, timeout=600)

    def cpu_s(self) -> float:
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """The daemon's user and system CPU seconds so far (system: its syscalls and the kernel's work for its
        sockets done in its time, the links' shaping included)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick

    def peak_rss_mb(self) -> float:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{self.proc.pid}/status").read_text())
        return int(m[1]) / 1024 if m else 0.0

    def metric(self, text: str, name: str, label: str = "") -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and label in line.split(" ", 1)[0])


def start_daemon(i: int, n: int, work: Path, token: Path, chunk: str, port: int = 5000, serve: int = 0) -> Daemon:
    home = work / f"n{i}"
    home.mkdir(parents=True)
    peers = [f"http://{node_ip(j)}:{PEER_PORT}" for j in range(n) if j != i]
    config = {"root": str(home / "store"), "socket": str(home / "api.sock"),
              "peerListen": f"{node_ip(i)}:{PEER_PORT}", "peerTokenFile": str(token), "peers": peers,
              "endpoints": {"s3": {"endpointUrl": f"http://{ORIGIN_IP}:{port}"}}, "chunkSize": chunk,
              "minFreePercent": 0,  # throwaway stores: a disk that other work filled past 11 % must not fail a row
              "bytesPerSecond": {"serve": serve}}  # what its peer server sends, all peers together (0: no limit)
    # a directory of its own: the daemon watches its config's directory, and its log and store beside it made
    # every log line and progress write an inotify event for the watcher (0.1 CPU s of 1 a node in a fill)
    (home / "etc").mkdir()
    (home / "etc" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    log = home / "daemon.log"
    env = {**os.environ, **AWS_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}n{i}", "nice", "-n", "10", PY, "-m", "weightcache",
                                 "daemon", "--config", str(home / "etc" / "config.yaml"), "--node-name", f"n{i}"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    return Daemon(i, proc, home / "api.sock", log)


def wait_answering(daemons: list[Daemon], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    for d in daemons:
        while not (d.socket.exists() and d.client().available()):
            if d.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon n{d.index} did not start: {d.log.read_text()[-2000:]}")
            time.sleep(0.2)


def stop_all(daemons: list[Daemon]) -> None:
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.terminate()
    deadline = time.monotonic() + 20  # for all of them: a daemon stuck in a fetch costs 20 s once, not each
    for d in daemons:
        try:
            d.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()


OUTAGE_S = 10.0  # from the fill's start the origin answers every request 503 SlowDown this long
# --faults: a third of the nodes are killed (SIGKILL) this far into the fill, and one node's link drops every
# packet (`cut_off`) for CUT_FOR_S: after the outage, mid-transfer (at 3 s and 4 s, as before session 46, the
# origin's 503s still held every node in its listing: the killed nodes had read nothing, nor the cut one)
KILL_AT_S = OUTAGE_S + 8.0
CUT_AT_S, CUT_FOR_S = OUTAGE_S + 10.0, 10.0
LATE_S = 6.0  # one node is asked for the model this much later than the others
PROXY_PORT = 5001  # --faults: the daemons reach moto through a fault proxy (tests/faultproxy.py) in its namespace
OUTAGE_PROXY = """
import signal, sys, threading, time
from tests import faultproxy
from tests.faultproxy import FaultProxy
proxy = FaultProxy(sys.argv[1], sys.argv[2], int(sys.argv[3]))
# per client address: its last request answered 503, and its first request once the outage was over (written to
# sys.argv[5] + ".through", seconds from the outage's end: how long each node's backoff outlasted it)
lock, state = threading.Lock(), {"over": None, "last503": {}, "through": set()}
handle = faultproxy._Handler._handle
def _handle(self):
    now, ip = time.monotonic(), self.client_address[0]
    with lock:
        if state["over"] is None:
            state["last503"][ip] = now
        elif ip not in state["through"]:
            state["through"].add(ip)
            last = state["last503"].get(ip)
            before = "-" if last is None else "%.2f" % (last - state["over"])
            with open(sys.argv[5] + ".through", "a") as f:
                f.write("%s %.2f %s\\n" % (ip, now - state["over"], before))
    return handle(self)
for verb in ("GET", "PUT", "POST", "PATCH", "DELETE", "HEAD"):
    setattr(faultproxy._Handler, "do_" + verb, _handle)
def outage(*_):
    fault = proxy.add("status", status=503, code="SlowDown", count=-1)
    with lock:
        state.update(over=None, last503={}, through=set())
        open(sys.argv[5] + ".through", "w").close()
    def over():
        with lock:
            proxy.clear()
            state["over"] = time.monotonic()
        with open(sys.argv[5], "w") as f:
            f.write(str(fault.fired))
    threading.Timer(float(sys.argv[4]), over).start()
signal.signal(signal.SIGUSR1, outage)
print("ready", flush=True)
while True:
    signal.pause()
"""


def fault_roles(n: int, faults: bool, liar: bool) -> dict[int, str]:
    """Which node suffers what: every third from n1 killed, then one cut off, the last one late (`faults`);
    n0 a liar (`liar`)."""
    roles = dict.fromkeys(range(1, n, 3), "killed") if faults else {}
    rest = [i for i in range(n) if i not in roles]
    if faults and len(rest) >= 3:
        roles[rest[-2]] = "cut"
        roles[rest[-1]] = "late"
    if liar and n >= 2:
        roles[0] = "liar"
    return roles


def make_liar(d: Daemon, uri: str, home: Path, chunk: int) -> None:
    """The liar holds the whole model before the fill (read from the origin before the row's count starts) and
    then serves other bytes: one byte flipped in every piece of every blob, under the daemon's feet (root)."""
    d.client().ensure(uri)
    for blob in (home / "store" / "blobs").rglob("*"):
        if blob.is_file() and not blob.is_symlink():
            with blob.open("r+b") as f:
                for at in range(0, blob.stat().st_size, chunk):
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ 0xFF]))


def inject(net: Net, daemons: list[Daemon], roles: dict[int, str],
           outage: subprocess.Popen[bytes] | None) -> float | None:
    """Kill, cut and restore on the schedule above; the wall time of the cut (None: no node cut)."""
    started, cut_at = time.monotonic(), None
    if outage is not None:  # the proxy answers 503 from the start for OUTAGE_S: every first list, HEAD and GET
        outage.send_signal(signal.SIGUSR1)
    time.sleep(KILL_AT_S)
    for d in daemons:
        if roles.get(d.index) == "killed":
            d.proc.kill()
    time.sleep(max(0.0, CUT_AT_S - (time.monotonic() - started)))
    cut = [f"n{i}" for i, role in roles.items() if role == "cut"]
    for name in cut:
        cut_off("eth0", PREFIX + name)
        cut_off(f"wcfh-{name}")
        cut_at = time.time()
    time.sleep(CUT_FOR_S)
    for name in cut:  # back: it finishes its own fetch from whoever has the model by then
        net.limit_both(name, net.link_mbps)
    return cut_at


# a range handed on from the node that was serving it ("not there"): peers/source.py PeerSource._hand_over
HANDED = re.compile(r"^(\S+ \S+) \S+ weightcache\.peers\.source: \S+ bytes \d+-\d+: .* reads them from the origin "
                    r"now \((\S+) is not there for them\)", re.M)


def cut_moves(log_text: str, cut_url: str, cut_at: float) -> list[float]:
    """Seconds after the cut at which this daemon handed each range it waited on from the node cut off to another
    node (its log's hand-over lines naming that node, while the link was down)."""
    moved = []
    for m in HANDED.finditer(log_text):
        at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged
        if m[2] == cut_url and cut_at <= at <= cut_at + CUT_FOR_S:
            moved.append(round(at - cut_at, 1))
    return moved


# the first that a line's reason holds names it: a node's own share read with no peer holding anything yet (the
# first node through) is its own share, not "no holder known"
WHY = (("read again", "relay read again"), ("no byte for", "pending expired"), ("next in rank", "taken over"),
       (" cut", "after a cut"), (" failed", "after a failure"), ("gone", "holder gone"), ("own share", "own share"),
       (", 0 holders", "no holder known"), ("judging", "judging a peer"))


def origin_reads(log_text: str) -> dict[str, float]:
    """Bytes a daemon read from the origin, by why (its `origin read:` log lines, peers/source.py)."""
    why: dict[str, float] = {}
    for m in re.finditer(r"origin read: .* \((\d+)\): (.*)", log_text):
        kind = next((k for word, k in WHY if word in m[2]), "other")
        why["why:" + kind] = why.get("why:" + kind, 0.0) + int(m[1])
    return why


def sample_links(path: Path, names: list[str], started: float, filled: threading.Event) -> None:
    """Every 0.5 s until the row's nodes are all ready, one line per node to `path` (appended): fleet size, seconds
    since the ask, node, bytes it sent and bytes it received so far (its bridge port's counters: what crossed its
    link, TCP/IP headers included)."""
    with path.open("a") as out:
        while not filled.wait(0.5):
            at = time.monotonic() - started
            for name in names:
                stats = Path(f"/sys/class/net/wcfh-{name}/statistics")
                with contextlib.suppress(OSError):  # a node's link dropped (--faults)
                    sent, got = (stats / "rx_bytes").read_text().strip(), (stats / "tx_bytes").read_text().strip()
                    out.write(f"{len(names)} {at:.2f} {name} {sent} {got}\n")
            out.flush()


def serve_limit(args: argparse.Namespace) -> int:
    """Each daemon's bytesPerSecond.serve: a share of its link, set below it as an operator would (docs/peers.md,
    "Serving below the uplink"); the summary says which, so a row is never read as the unlimited case."""
    return int(args.serve_share * args.link_mbps * 1e6)


def fill(net: Net, n: int, work: Path, args: argparse.Namespace, model: int) -> dict[str, Any]:
    """One row: n fresh node namespaces and daemons, all asked for the model at once."""
    run_dir = work / f"run-{n}"
    names = [f"n{i}" for i in range(n)]
    for i, name in enumerate(names):
        net.namespace(name, node_ip(i))
        net.limit_both(name, args.link_mbps)
    serve = serve_limit(args)
    daemons = [start_daemon(i, n, run_dir, work / "token", args.chunk_size, PROXY_PORT if args.outage else 5000, serve)
               for i in range(n)]
    try:
        wait_answering(daemons)
        uri = f"s3://{BUCKET}/model/"
        roles = fault_roles(n, args.faults, args.liar)
        for d in daemons:
            if roles.get(d.index) == "liar":
                make_liar(d, uri, run_dir / f"n{d.index}", parse_size(args.chunk_size, "--chunk-size"))
        for d in daemons:
            d.cpu_before, d.sys_before = d.cpu_s(), d.cpu_split()[1]
        sent_before = tx_bytes(PREFIX + "origin", "eth0")
        started = time.monotonic()

        def one(d: Daemon) -> None:
            if roles.get(d.index) == "late":
                time.sleep(LATE_S)
            try:
                d.client().ensure(uri)
            except Exception as exc:  # a row reports a failed node, it does not end the bench
                d.error = f"{type(exc).__name__}: {exc}"
            d.ready_s = time.monotonic() - started

        pool = ThreadPoolExecutor(n + 2)
        filled = threading.Event()
        faults = None
        try:
            if roles:
                faults = pool.submit(inject, net, daemons, roles, args.outage if n > 1 else None)
            if args.link_samples:
                pool.submit(sample_links, Path(args.link_samples), names, started, filled)
            list(pool.map(one, daemons))
        finally:  # Ctrl-C or SIGTERM: on to stopping the daemons (their asks then end), not waiting for them
            filled.set()
            pool.shutdown(wait=False, cancel_futures=True)
        cut_at = None
        if faults is not None:  # a fault that could not be injected ends the bench, not a row that claims it
            cut_at = faults.result()  # (a `tc ... netem` this kernel lacks failed unseen: the "cut" node was not)
        egress = tx_bytes(PREFIX + "origin", "eth0") - sent_before
        for d in daemons:
            if roles.get(d.index) == "killed":
                d.error = ""  # its fetch died with it, as planned
                continue
            text = d.client()._call("GET", "/metrics", raw=True)
            d.stats = {"cpu_s": d.cpu_s() - d.cpu_before, "sys_s": d.cpu_split()[1] - d.sys_before,
                       "rss_mb": d.peak_rss_mb(),
                       "origin": d.metric(text, "weightcache_model_fetched_bytes_total", 'source="origin"'),
                       "peers": d.metric(text, "weightcache_model_fetched_bytes_total", 'source="peers"'),
                       "served": d.metric(text, "weightcache_peer_served_bytes_total"),
                       "cuts": len(re.findall(r"below the floor", d.log.read_text())),
                       "lies": len(re.findall(r"that the origin contradicts", d.log.read_text())),
                       # of those: pieces taken and judged before use (PeerSource._judged), never used; and
                       # digests a peer vouched for (of another's piece) that the origin contradicts: no piece
                       "judged": len(re.findall(r"judged before use", d.log.read_text())),
                       "false_digests": len(re.findall(r"vouched for a digest", d.log.read_text())),
                       **origin_reads(d.log.read_text())}
            cut_url = next((f"http://{node_ip(i)}:{PEER_PORT}" for i, role in roles.items() if role == "cut"), "")
            if cut_at is not None and roles.get(d.index) != "cut":
                d.moved = cut_moves(d.log.read_text(), cut_url, cut_at)
    finally:
        stop_all(daemons)
        if args.keep_logs:
            dest = Path(args.keep_logs) / f"n{n}"
            dest.mkdir(parents=True, exist_ok=True)
            for d in daemons:
                shutil.copy(d.log, dest / f"n{d.index}.log")
        for name in names:
            net.drop(name)
        shutil.rmtree(run_dir, ignore_errors=True)
    served = [d.stats.get("served", 0.0) for d in daemons]
    live = [d for d in daemons if roles.get(d.index) != "killed"]
    mean_served = sum(d.stats.get("served", 0.0) for d in live) / len(live)  # the killed serve nothing after
    return {
        "nodes": n,
        "serve_limit_bytes_s": serve,
        "faults": {f"n{i}": role for i, role in sorted(roles.items())},
        # with nodes killed their counts die with them: then the origin veth's bytes (overhead included)
        "origin_bytes_ratio": round((egress if roles else sum(d.stats.get("origin", 0.0) for d in daemons)) / model,
                                    3),
        "origin_egress_ratio": round(egress / model, 3),
        "ready_s": [round(d.ready_s, 2) for d in daemons],
        "all_ready_s": round(max(d.ready_s for d in live), 2),
        "cpu_s": [round(d.stats.get("cpu_s", 0.0), 2) for d in daemons],
        "cpu_sys_s": [round(d.stats.get("sys_s", 0.0), 2) for d in daemons],  # of cpu_s: the kernel's
        "rss_mb": [round(d.stats.get("rss_mb", 0.0)) for d in daemons],
        "max_rss_mb": round(max(d.stats.get("rss_mb", 0.0) for d in daemons)),
        "served_mb": [round(s / 1e6, 1) for s in served],
        "max_served_share": round(max(served) / mean_served, 2) if mean_served else 0.0,
        "peer_cuts": sum(int(d.stats.get("cuts", 0)) for d in daemons),
        # --faults: pieces each node took from the liar before it banned it (one ban line each)
        "lies_caught": [int(d.stats.get("lies", 0)) for d in daemons],
        # pieces each node took from the liar: used (found when their blob failed), judged before use (never used)
        "liar_pieces_used": [int(d.stats.get("lies", 0) - d.stats.get("judged", 0) - d.stats.get("false_digests", 0))
                             for d in daemons],
        "liar_pieces_judged": [int(d.stats.get("judged", 0)) for d in daemons],
        "false_digests": [int(d.stats.get("false_digests", 0)) for d in daemons],
        # --faults: per node, seconds after the cut at which it handed each range it waited on from the node cut
        # off to another node (the target: within 1 s)
        "cut_moved_s": {f"n{d.index}": d.moved for d in daemons if d.moved},
        "cut_at": cut_at,  # --faults: the cut's wall time (the daemons' logs' clock), None without a cut
        "origin_why": {k[4:]: round(sum(d.stats.get(k, 0.0) for d in daemons) / model, 3)
                       for k in sorted({k for d in daemons for k in d.stats if k.startswith("why:")})},
        "errors": [f"n{d.index}: {d.error}" for d in daemons if d.error],
        # --faults: requests the origin answered 503 during its outage (0: none came then)
        "origin_503s": int(outage_log.read_text()) if (outage_log := work / "503s").exists() else None,
        # --faults: per node, seconds from the outage's end to its first request to the origin after it, and to its
        # last request answered 503 (negative: before the end); how long its backoff outlasted the outage
        "out_of_503s_s": out_of_503s(work / "503s.through", n),
    }


def out_of_503s(path: Path, n: int) -> dict[str, list[float | None]]:
    """The fault proxy's per-address lines (`OUTAGE_PROXY`), by node: [first request after, last 503]."""
    names = {node_ip(i): f"n{i}" for i in range(n)}
    rows = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        ip, through, last = line.split()
        if ip in names:
            rows[names[ip]] = [float(through), None if last == "-" else float(last)]
    return dict(sorted(rows.items(), key=lambda kv: int(kv[0][1:])))


@contextlib.contextmanager
def origin(net: Net, work: Path, args: argparse.Namespace) -> Iterator[int]:
    """moto in its namespace with the model uploaded (before its link is limited); yields the model's bytes."""
    import boto3
    from botocore.config import Config

    ns = net.namespace("origin", ORIGIN_IP)
    moto = subprocess.Popen(["ip", "netns", "exec", ns, PY, "-m", "moto.server", "-H", ORIGIN_IP, "-p", "5000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **AWS_ENV})
    try:
        model_dir = work / "model"
        make_model(model_dir, args.model_mb / 1000, args.shards)
        os.environ.update(AWS_ENV)
        s3 = boto3.client("s3", endpoint_url=f"http://{ORIGIN_IP}:5000", config=Config(s3={"addressing_style": "path"}))
        deadline = time.monotonic() + 60
        while True:
            try:
                s3.create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline or moto.poll() is not None:
                    raise
                time.sleep(0.3)
        model = 0
        for path in sorted(model_dir.iterdir()):
            s3.put_object(Bucket=BUCKET, Key=f"model/{path.name}", Body=path.read_bytes(), ChecksumAlgorithm="SHA256")
            model += path.stat().st_size
        shutil.rmtree(model_dir)
        net.limit_both("origin", args.origin_mbps)
        if args.faults:  # the daemons reach moto through the fault proxy, which `inject` turns to 503 a while
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            args.outage = subprocess.Popen(["ip", "netns", "exec", ns, PY, "-c", OUTAGE_PROXY, f"http://{ORIGIN_IP}:5000",
                                            ORIGIN_IP, str(PROXY_PORT), str(OUTAGE_S), str(work / "503s")],
                                           stdout=subprocess.PIPE, env=env)
            assert args.outage.stdout is not None
            if args.outage.stdout.readline().strip() != b"ready":
                raise RuntimeError("the origin's fault proxy did not start")
        yield model
    finally:
        for proc in (moto, args.outage):
            if proc is not None:
                proc.terminate()
                proc.wait(10)


def print_row(row: dict[str, Any], one: float) -> None:
    print(f"N={row['nodes']}: origin {row['origin_bytes_ratio']:.2f}x the model (egress with overhead "
          f"{row['origin_egress_ratio']:.2f}x); all ready {row['all_ready_s']:.1f} s = {row['all_ready_ratio']:.2f}x "
          f"one node alone; peer cuts {row['peer_cuts']}; max served share {row['max_served_share']:.2f}")
    print(f"  ready s:   {' '.join(f'{x:.1f}' for x in row['ready_s'])}")
    print(f"  CPU s:     {' '.join(f'{x:.1f}' for x in row['cpu_s'])} (all {sum(row['cpu_s']):.0f}, of it system "
          f"{sum(row['cpu_sys_s']):.0f})")
    print(f"  RSS MiB:   {' '.join(str(x) for x in row['rss_mb'])}")
    print(f"  served MB: {' '.join(f'{x:.0f}' for x in row['served_mb'])}")
    if row.get("cut_moved_s"):
        moves = [x for v in row["cut_moved_s"].values() for x in v]
        each = " ".join(f"{k}=" + ",".join(f"{x:g}" for x in v) for k, v in row["cut_moved_s"].items())
        print(f"  cut node's ranges handed on, s after the cut (per node, each range it waited on; max "
              f"{max(moves):.1f}): {each}")
    print(f"  origin by why (x the model): {', '.join(f'{k} {v:.2f}' for k, v in row['origin_why'].items())}")
    if row["faults"]:
        liar = ", the liar's own fill before the row not counted" if "liar" in row["faults"].values() else ""
        print(f"  faults:    {' '.join(f'{k}={v}' for k, v in row['faults'].items())} (origin: its veth's bytes"
              f"{liar})")
        print(f"  lies caught (then banned): {' '.join(str(x) for x in row['lies_caught'])}: pieces from the liar "
              f"used {' '.join(str(x) for x in row['liar_pieces_used'])}, judged before use (never used) "
              f"{' '.join(str(x) for x in row['liar_pieces_judged'])}, false digests "
              f"{' '.join(str(x) for x in row['false_digests'])}; origin 503s: {row['origin_503s']}")
    if row.get("out_of_503s_s"):
        out = row["out_of_503s_s"]
        print(f"  out of the 503s, s after they ended (per node: first origin request after; its last 503): "
              f"{' '.join(f'{k}={v[0]:g}' + ('' if v[1] is None else f'({v[1]:g})') for k, v in out.items())}")
    for e in row["errors"]:
        print(f"  FAILED {e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="16", help="comma-separated fleet sizes")
    parser.add_argument("--model-mb", type=int, default=32, help="model size, MB (10^6 bytes)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--chunk-size", default="256Ki",
                        help="the daemons' chunkSize: a fleet's ranges are 4 pieces of min(1 MiB, this) or more")
    parser.add_argument("--origin-mbps", type=float, default=1.0, help="the origin's link, MB/s each way")
    parser.add_argument("--link-mbps", type=float, default=1.0, help="each node's link, MB/s each way")
    parser.add_argument("--serve-share", type=float, default=SERVE_SHARE,
                        help="each daemon's bytesPerSecond.serve as a share of --link-mbps (0: no serving limit)")
    parser.add_argument("--liar", action="store_true",
                        help="n0 holds the model with a byte flipped in every piece (a lying peer)")
    parser.add_argument("--json", action="store_true", help="print one JSON summary (the last N's row)")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy every daemon's log here")
    parser.add_argument("--link-samples", metavar="FILE",
                        help="append each node's sent and received bytes every 0.5 s of each row's fill here: "
                             "'N SECONDS NODE SENT RECEIVED' (its link's counters, headers included)")
    parser.add_argument("--faults", action="store_true",
                        help=f"every third node killed -9 at {KILL_AT_S:g} s, one node's link at 100%% loss from "
                             f"{CUT_AT_S:g} s for {CUT_FOR_S:g} s, the origin answering 503 from 0 s for "
                             f"{OUTAGE_S:g} s, one node asked {LATE_S:g} s late")
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"):
        print("bench_fleet_netns: needs root and iproute2 (ip, tc): it makes namespaces, veths and qdiscs",
              file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.nodes.split(",")]
    args.outage = None  # --faults: the origin's fault proxy (origin())
    net = Net(max(sizes))
    net.link_mbps = args.link_mbps
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below removes the net
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-netns-") as tmp:
            work = Path(tmp)
            (work / "token").write_text(TOKEN)
            with origin(net, work, args) as model:
                load = os.getloadavg()[0]
                one_row = fill(net, 1, work, args, model)
                one = one_row["all_ready_s"]
                if not args.json:
                    print(f"model {model / 1e6:.0f} MB in {args.shards} shards; origin link {args.origin_mbps:g} MB/s, "
                          f"node links {args.link_mbps:g} MB/s each way; each daemon serves peers at most "
                          f"{serve_limit(args) / 1e6:g} MB/s (bytesPerSecond.serve, --serve-share "
                          f"{args.serve_share:g}; 0: no limit); one node alone: {one:.1f} s "
                          f"(origin {one_row['origin_bytes_ratio']:.2f}x); load average {load:.1f}")
                for n in sizes:
                    row = fill(net, n, work, args, model)
                    row["all_ready_ratio"] = round(row["all_ready_s"] / one, 2)
                    row["one_node_s"] = one
                    row["load_average"] = round(os.getloadavg()[0], 1)
                    rows.append(row)
                    if not args.json:
                        print_row(row, one)
    finally:
        net.close()
    if args.json:
        print(json.dumps({**rows[-1], "model_bytes": model, "rows": rows}))
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
