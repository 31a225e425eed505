"""Log lines through `redact`: the formatter our entry points wrap their handlers' in, so that every line a
weightcache process writes passes it (weightcache/redact.py). Kept out of redact.py, which does not import logging."""

from __future__ import annotations

import logging

from weightcache.redact import redact


class RedactingFormatter(logging.Formatter):
    """Wraps a handler's formatter so the whole rendered line (traceback included) passes `redact`."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def redact_log_handlers(logger: logging.Logger | None = None) -> None:
    """Make every handler of `logger` (default: root) redact what it writes; idempotent."""
    for handler in (logger or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter))
