"""`weightcache webhook` and `weightcache webhook certs`: argument parsing and wiring, nothing else.

In a cluster (a Kubernetes config is found) the policy reads ModelCache objects from a watcher and undeclared
models are refused by default; off-cluster there are no ModelCaches and undeclared models are allowed by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.errors import ConfigError
from weightcache.vocabulary import UNKNOWN_ANNOTATION_MODES

if TYPE_CHECKING:  # the server pulls in aiohttp: imported only when the command runs, so every CLI call stays fast
    from weightcache.webhook.server import Policy

log = logging.getLogger(__name__)

DEFAULT_PORT = 8443


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `webhook` (and its `certs` subcommand) to the CLI's subparsers."""
    hook = sub.add_parser("webhook", help="run the mutating admission webhook (POST /mutate over TLS)")
    hook.add_argument("--cert", type=Path, help="PEM serving certificate (chain); reloaded when it changes")
    hook.add_argument("--key", type=Path, help="PEM private key of --cert")
    hook.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTPS port (default {DEFAULT_PORT}; 0: any)")
    hook.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0, for the Service)")
    hook.add_argument(
        "--allow-undeclared",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow models no ModelCache declares (default: yes off-cluster, no in a cluster)",
    )
    hook.add_argument(
        "--max-models",
        type=_positive,
        default=None,
        metavar="N",
        help="most models one pod may name; a pod with more is denied, saying so (default 16)",
    )
    hook.add_argument(
        "--unknown-annotations",
        choices=UNKNOWN_ANNOTATION_MODES,
        default="warn",
        help="a weightcache.io/ annotation key the webhook does not know (a typo): warn, naming the nearest known "
             "key, or deny the pod (default warn)",
    )
    hook.add_argument(
        "--controller",
        action="store_true",
        help="also run the placement controller (leader-elected on a Lease; docs/placement.md)",
    )
    hook.add_argument(
        "--dra",
        action="store_true",
        help="refuse `weightcache.io/via: dra` pods whose ResourceClaimTemplate is missing (watches templates; "
             "deploy/dra sets it)",
    )
    hook.set_defaults(func=run_webhook)
    nested = hook.add_subparsers(dest="webhook_command", metavar="{certs}")
    certs = nested.add_parser("certs", help="write a CA and a serving certificate for <service>.<namespace>.svc")
    certs.add_argument("--service", required=True, help="the webhook's Service name")
    certs.add_argument("--namespace", required=True, help="the Service's namespace")
    certs.add_argument("--out", type=Path, default=Path("."), help="directory for ca.crt, tls.crt, tls.key")
    certs.set_defaults(func=run_certs)


def run_webhook(args: argparse.Namespace) -> int:
    if args.cert is None or args.key is None:
        print(
            "weightcache webhook needs --cert FILE and --key FILE (make them with: weightcache webhook certs "
            "--service S --namespace NS --out DIR, or mount cert-manager's Secret)",
            file=sys.stderr,
        )
        return 2
    try:
        policy, stop = _policy(args.allow_undeclared, controller=args.controller, dra=args.dra,
                               max_models=args.max_models)
        if args.max_models is not None:
            policy = dataclasses.replace(policy, max_models=args.max_models)
        policy = dataclasses.replace(policy, unknown_annotations=args.unknown_annotations)
    except ConfigError as exc:
        print(f"weightcache webhook: {exc}", file=sys.stderr)
        return 2

    def ready(port: int) -> None:
        print(
            f"webhook listening on https://{args.host}:{port}/mutate (allow undeclared models: "
            f"{policy.allow_undeclared})",
            file=sys.stderr,
            flush=True,
        )

    try:
        import asyncio  # here, not at the top: every CLI call builds this parser (asyncio: 40-180 ms)

        from weightcache.webhook.server import serve

        asyncio.run(serve(policy, cert=args.cert, key=args.key, host=args.host, port=args.port, on_ready=ready))
    except ConfigError as exc:
        print(f"weightcache webhook: {exc}", file=sys.stderr)
        return 2
    finally:
        stop()
    return 0


def _positive(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1; write e.g. --max-models 16")
    return int(text)


def run_certs(args: argparse.Namespace) -> int:
    try:
        from weightcache.webhook.certs import write_service_certs

        ca_bundle = write_service_certs(args.out, service=args.service, namespace=args.namespace)
    except OSError as exc:
        print(
            f"weightcache webhook certs: cannot write {exc.filename or args.out}: {exc.strerror}; "
            f"choose a writable --out directory",
            file=sys.stderr,
        )
        return 1
    out = args.out
    print(
        f"wrote {out / 'ca.crt'}, {out / 'tls.crt'}, {out / 'tls.key'} for {args.service}.{args.namespace}.svc\n"
        f"next:\n"
        f"  kubectl -n {args.namespace} create secret tls weightcache-webhook-tls "
        f"--cert {out / 'tls.crt'} --key {out / 'tls.key'}\n"
        f"  kubectl patch mutatingwebhookconfiguration weightcache --type=json -p "
        f'\'[{{"op":"add","path":"/webhooks/0/clientConfig/caBundle","value":"{ca_bundle}"}}]\'\n'
        f"the caBundle alone is on stdout",
        file=sys.stderr,
    )
    print(ca_bundle)
    return 0


def _policy(allow_undeclared: bool | None, *, controller: bool = False, dra: bool = False,
            max_models: int | None = None) -> tuple[Policy, Callable[[], None]]:
    """(policy, stop): ModelCaches and nodes from watchers when a cluster config is found, else none;
    with `controller`, the placement controller too (refusing what the webhook refuses: `max_models`); with
    `dra`, a watch of ResourceClaimTemplates so `via: dra` pods without theirs are refused. `max_models` None:
    pods.annotations.MAX_MODELS (imported here: the pods package is no import of every CLI command's parser)."""
    from weightcache.pods.annotations import MAX_MODELS
    from weightcache.webhook.server import Policy

    try:
        from weightcache.kube.client import load_api_client
        from weightcache.kube.watch import ModelCacheWatcher
    except ImportError:
        log.info("weightcache.kube is not available: running off-cluster")
        api_client = None
    else:
        api_client = load_api_client()
    if api_client is None:
        if controller:
            raise ConfigError("--controller needs a cluster (no in-cluster service account or kubeconfig found)")
        allow = True if allow_undeclared is None else allow_undeclared
        return Policy(model_caches=list, allow_undeclared=allow), lambda: None
    from weightcache.placement.command import node_view, start_controller
    from weightcache.policy import CacheIndex

    index = CacheIndex(())

    def changed(items: list[dict[str, Any]]) -> None:  # the watcher's thread: reviews only read the new index
        nonlocal index
        index = CacheIndex(items)

    watcher = ModelCacheWatcher(api_client, on_change=changed)
    watcher.start()
    # Gating needs someone to lift the gate: without the controller the webhook does not look at nodes at all
    nodes, stop_nodes = node_view(api_client) if controller else (lambda: None, lambda: None)
    controlling = [start_controller(api_client, max_models=max_models or MAX_MODELS)] if controller else []
    stops = [watcher.stop, stop_nodes, *controlling]
    if dra:
        from weightcache.webhook import dra_templates

        templates = dra_templates.watch(api_client)
        classes = dra_templates.watch(api_client, "deviceclasses")  # for weightcache.io/via: dra-extended
        dra_templates.install(dra_templates.from_watcher(templates), dra_templates.from_watcher(classes))
        stops += [templates.stop, classes.stop]
    allow = False if allow_undeclared is None else allow_undeclared

    def stop() -> None:
        for fn in reversed(stops):
            fn()

    return Policy(lambda: index, allow, synced=lambda: watcher.wait_synced(0), nodes=nodes), stop
