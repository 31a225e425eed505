"""`weightcache daemon`: the CLI wiring. cli.py calls `add_commands(subparsers)`.

Its flags are the settings' own (weightcache/daemon/config.py: a key's `Flag`, help from its docstring), declared
only once `daemon` is the command being parsed or its help shown: the settings import the store, the peers and the
engine caches, which every other command starts without (0.3 s more for `weightcache ls` at load 20).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from weightcache.errors import ConfigError
from weightcache.redact_logs import redact_log_handlers

log = logging.getLogger(__name__)


def add_commands(sub: Any) -> None:
    """Add `daemon` to the CLI's subparsers (cli.CommandParser: `declare` runs once it parses or shows help); its
    `func(args) -> int` runs it."""
    p = sub.add_parser("daemon", help="run the node daemon (API, reconcile, metrics, CSI with --csi-endpoint)",
                       description="Run the weightcache node daemon. Flags win over environment, environment "
                                   "over the config file (fields: docs/config.md).", declare=_declare)
    p.add_argument("--config", help="YAML config file (env WEIGHTCACHE_CONFIG); watched and applied live")
    p.set_defaults(func=run_daemon)


def _declare(parser: argparse.ArgumentParser) -> None:
    """A flag for each settings key that has one; its text is parsed with the file's and the env's."""
    from weightcache.daemon.config import GROUPS, KEYS, Settings, value_of
    from weightcache.settings import add_flag, docs_of

    docs = {group: docs_of(GROUPS[group] if group else Settings) for group, _, _ in KEYS.values()}
    for name, (group, attr, key) in KEYS.items():
        if key.flag is not None and key.flag.daemon:
            add_flag(parser, key, dest=name, doc=docs[group][attr], default=value_of(Settings(), name))


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """The daemon's flags as config keys (None = not given)."""
    from weightcache.daemon.config import KEYS

    return {name: value for name, value in vars(args).items() if name in KEYS}


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
