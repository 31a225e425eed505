"""The CSI boundary: exceptions become gRPC status codes by one table, and every RPC is logged once.

Codes follow the CSI spec's error tables: kubelet retries UNAVAILABLE/ABORTED and shows the message in the
pod's events, so every message says what is happening and what to do next. Anything unexpected becomes
INTERNAL and is logged with its traceback. Fields marked `csi_secret` in the proto are never logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from weightcache import errors
from weightcache.csi._pb import csi_pb2
from weightcache.redact import redact, shorten

LOGGED_REQUEST_CHARS = 8192

logger = logging.getLogger(__name__)


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC code each error declares (weightcache.errors); INTERNAL for anything unexpected."""
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode[errors.answer_for(exc).grpc_code]


class Redacted:
    """Lazy, secret-free rendering of a request for log lines (only formatted when a line is emitted)."""

    def __init__(self, message: Message) -> None:
        self.message = message

    def __str__(self) -> str:
        clean = type(self.message)()
        clean.CopyFrom(self.message)
        _strip(clean)
        return shorten(redact(str(clean).replace("\n", " ").strip()) or "{}", LOGGED_REQUEST_CHARS)


def _strip(message: Message) -> None:
    for field, value in message.ListFields():
        if field.GetOptions().Extensions[csi_pb2.csi_secret]:  # type: ignore[index]  # stubs type it loosely
            message.ClearField(field.name)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if field.is_repeated else (value,):
                _strip(item)


Observe = Callable[[str, float, str], None]  # (method, seconds, gRPC code): the daemon's metrics


class Observed(Protocol):
    """A servicer whose RPCs `rpc` wraps: it says who hears each call's time and code (None: nobody)."""

    observe: Observe | None


Servicer = TypeVar("Servicer", bound=Observed)
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
Handler = Callable[[Servicer, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]


def rpc(handler: Handler[Servicer, Req, Resp]) -> Handler[Servicer, Req, Resp]:
    """Wrap a servicer method: log the call without secrets, translate exceptions by their declared gRPC code."""
    return _wrap(handler, logging.INFO)


def quiet_rpc(handler: Handler[Servicer, Req, Resp]) -> Handler[Servicer, Req, Resp]:
    """`rpc` for calls a CO repeats every few seconds (Probe, capabilities): success is logged at DEBUG."""
    return _wrap(handler, logging.DEBUG)


def _wrap(handler: Handler[Servicer, Req, Resp], ok_level: int) -> Handler[Servicer, Req, Resp]:
    @functools.wraps(handler)
    async def wrapper(self: Servicer, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        name = handler.__name__
        start = time.monotonic()
        logger.debug("%s request: %s", name, Redacted(request))
        try:
            response = await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:  # the caller went away (its deadline passed)
            _observe(self, name, start, "CANCELLED")
            raise
        except Exception as exc:  # the boundary: every error becomes a status
            code = code_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                message = shorten(redact(f"internal error: {exc}; see the weightcache daemon's log"))
                logger.exception("%s failed: %s (request: %s)", name, message, Redacted(request))
            else:
                message = shorten(redact(str(exc)))  # kubelet copies it into the pod's events
                logger.info("%s -> %s: %s", name, code.name, message)
            _observe(self, name, start, code.name)
            await context.abort(code, message)
        _observe(self, name, start, "OK")
        logger.log(ok_level, "%s ok in %.1f ms", name, (time.monotonic() - start) * 1000)
        return response

    return wrapper


def _observe(servicer: Observed, method: str, start: float, code: str) -> None:
    if servicer.observe is not None:
        servicer.observe(method, time.monotonic() - start, code)
