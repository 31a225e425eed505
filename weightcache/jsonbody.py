"""Reading an untrusted JSON request body: one function for the daemon API and the webhook.

`json.loads` alone turns hostile bodies into 500s: deep nesting raises RecursionError (and a structure just under
the parser's limit raises it later, in whatever walks it), a 4,301-digit integer raises a bare ValueError, bad
UTF-8 a UnicodeDecodeError. Here each is the one InvalidRequestError with what to send instead.
"""

from __future__ import annotations

import json
from typing import Any

from weightcache.errors import InvalidRequestError

MAX_DEPTH = 64  # a Pod is about 12 levels deep; an API body 3


def parse_json(data: bytes, *, what: str = "request body", example: str = '{"uri": "s3://models/llama/"}') -> Any:
    """The decoded body; InvalidRequestError naming `what` when it is not JSON a caller should send."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise InvalidRequestError(what, f"is nested deeper than {MAX_DEPTH} levels; send JSON like {example}") from None
    except UnicodeDecodeError:
        raise InvalidRequestError(what, f"is not UTF-8; send JSON like {example}") from None
    except ValueError as exc:  # JSONDecodeError, and integers beyond the interpreter's digit limit
        raise InvalidRequestError(what, f"is not valid JSON ({str(exc)[:120]}); send JSON like {example}") from None
    if _depth(value) > MAX_DEPTH:
        raise InvalidRequestError(what, f"is nested deeper than {MAX_DEPTH} levels; send JSON like {example}")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, iteratively (recursion is what a hostile body is trying to exhaust)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
