"""`weightcache daemon`: the CLI wiring. cli.py calls `add_commands(subparsers)`."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from weightcache import defaults
from weightcache.errors import ConfigError
from weightcache.redact import redact_log_handlers

log = logging.getLogger(__name__)


def add_commands(sub: Any) -> None:
    """Add `daemon` to the CLI's subparsers; its `func(args) -> int` runs it."""
    p = sub.add_parser("daemon", help="run the node daemon (API, reconcile, metrics, CSI with --csi-endpoint)",
                       description="Run the weightcache node daemon. Flags win over environment, environment "
                                   "over the config file (fields: docs/config.md).")
    p.add_argument("--config", help="YAML config file (env WEIGHTCACHE_CONFIG); watched and applied live")
    p.add_argument("--root", help=f"store root (env WEIGHTCACHE_ROOT; default {defaults.ROOT})")
    p.add_argument("--socket", help=f"API socket (env WEIGHTCACHE_SOCKET; default {defaults.SOCKET})")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="also serve GET /metrics, read-only and without a token, on HOST:PORT "
                        "(env WEIGHTCACHE_METRICS_LISTEN)")
    p.add_argument("--peer-listen", metavar="HOST:PORT",
                   help="serve this node's verified blobs to peers on HOST:PORT (env WEIGHTCACHE_PEER_LISTEN; "
                        "needs --peer-token-file; docs/peers.md)")
    p.add_argument("--peer", action="append", metavar="URL", dest="peers",
                   help="http(s)://HOST:PORT of another node's peer listener; repeat for each peer")
    p.add_argument("--peer-token-file", metavar="FILE",
                   help="the fleet's shared peer token (env WEIGHTCACHE_PEER_TOKEN_FILE)")
    p.add_argument("--csi-endpoint", help="serve CSI on unix:///PATH (env CSI_ENDPOINT)")
    p.add_argument("--node-name", help="this node's Kubernetes name (env NODE_NAME)")
    p.add_argument("--dra", action="store_true", default=None,
                   help="serve the DRA kubelet plugin models.weightcache.io with default settings (docs/dra.md)")
    p.add_argument("--log-format", choices=("text", "json"), help="log lines as text or JSON (default text)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="default info")
    p.set_defaults(func=run_daemon)


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """Flags as config keys (None = not given)."""
    return {"root": args.root, "socket": args.socket, "csiEndpoint": args.csi_endpoint,
            "metricsListen": args.metrics_listen, "peerListen": args.peer_listen, "peers": args.peers,
            "peerTokenFile": args.peer_token_file, "nodeName": args.node_name, "dra": args.dra,
            "logFormat": args.log_format, "logLevel": args.log_level}


def run_daemon(args: argparse.Namespace) -> int:
    from weightcache.daemon.app import run
    from weightcache.daemon.config import load_settings

    flags = flags_of(args)
    try:
        settings = load_settings(args.config, env=os.environ, flags=flags)
    except ConfigError as exc:
        logging.basicConfig(format="%(levelname)s: %(message)s")
        redact_log_handlers()
        log.error("%s", exc)
        return 2
    return run(settings, env=dict(os.environ), flags=flags)
