"""What a pod's engine says about its own start: the report file the weightcache vLLM plugin writes at the root
of the pod's engine-cache volume, as the CSI plugin reads it (docs/telemetry.md).

    <engine-cache volume>/.weightcache-report     one JSON object, at most 4 KiB, replaced whole (tmp + rename)
    {"version": 1,
     "stages": {"weights_loaded": 1765012345.12, "engine_ready": …, "first_token": …},     Unix times, any subset
     "compile": {"result": "hit" | "miss" | "incompatible",
                 "key": "<hex>",           the compile key: vLLM's own factors, hashed (weightcache_vllm.compile_key)
                 "dir": "<hex>",           the torch_compile_cache/<dir> vLLM chose for this start
                 "handed": ["<hex>", …],   the torch_compile_cache/<dir>s the volume held before vLLM compiled
                 "written": 12}}           files vLLM added under its <dir> during this start

The pod writes it, so every byte is hostile: it is opened through the volume's directory descriptor without
following a link, must be a regular file, is read to a bound, and each field is checked (unknown keys are
ignored, a wrong one drops only itself). Its times are the pod's word on its own start: they are used only for
that pod's Events and observations, and only when they fall between the pod's first publish and now.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightcache.vocabulary import COMPILE_RESULTS, ENGINE_REPORT, ENGINE_STAGES

MAX_BYTES = 4096
MAX_HANDED = 16
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


@dataclass(frozen=True)
class CompileOutcome:
    """What the engine did with the compile cache it was handed (`result`, one of vocabulary.COMPILE_RESULTS)."""

    result: str
    key: str = ""
    dir: str = ""
    handed: tuple[str, ...] = ()
    written: int = 0


@dataclass(frozen=True)
class EngineReport:
    stages: Mapping[str, float] = field(default_factory=dict)  # stage -> Unix time
    compile: CompileOutcome | None = None


def parse(data: bytes) -> EngineReport:
    """The report in `data`; ValueError saying what is wrong with it as a whole (not JSON, not an object, too
    big). A field of the wrong type or range is left out, the rest kept."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{ENGINE_REPORT} is over {MAX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError(f"{ENGINE_REPORT} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise ValueError(f"{ENGINE_REPORT} is not a version 1 report object")
    stages = doc.get("stages")
    found = {s: float(t) for s, t in stages.items() if s in ENGINE_STAGES and _time(t)} \
        if isinstance(stages, dict) else {}
    return EngineReport(found, _compile(doc.get("compile")))


def _time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _compile(value: Any) -> CompileOutcome | None:
    if not isinstance(value, dict) or value.get("result") not in COMPILE_RESULTS:
        return None
    key, dir_ = value.get("key"), value.get("dir")
    handed = value.get("handed")
    written = value.get("written")
    return CompileOutcome(
        str(value["result"]),
        key if isinstance(key, str) and _HEX.match(key) else "",
        dir_ if isinstance(dir_, str) and _HEX.match(dir_) else "",
        tuple(h for h in handed[:MAX_HANDED] if isinstance(h, str) and _HEX.match(h)) if isinstance(handed, list)
        else (),
        written if isinstance(written, int) and not isinstance(written, bool) and 0 <= written < 1 << 31 else 0)


def read(directory: str) -> EngineReport | None:
    """The report at the root of `directory` (a volume's mount, seen through the plugin's walked parent fd); None
    when there is none. ValueError when it is not a readable regular file within the bound, or not a report."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not hang the reader
    try:
        top = os.open(directory, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        try:
            fd = os.open(ENGINE_REPORT, flags, dir_fd=top)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"{ENGINE_REPORT} cannot be opened without following a link "
                             f"({os.strerror(exc.errno or 0)})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{ENGINE_REPORT} is not a regular file")
            data = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
    finally:
        os.close(top)
    return parse(data)


def ready_at(directory: str, ready: str) -> float | None:
    """The modification time of the pod's ready file `ready` at the root of `directory` (a regular file, never
    through a link): when its startup probe saw the engine answer. None without one."""
    try:
        top = os.open(directory, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.stat(ready, dir_fd=top, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(top)
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None
