"""Byte sizes: Kubernetes quantities in, binary units out. The one grammar for flags, config files and env.

Accepted (as `resource.Quantity` writes them): a non-negative decimal number with an optional suffix
`Ki Mi Gi Ti Pi Ei` (powers of 1024), `k M G T P E` (powers of 1000) or an exponent (`1e9`). Fractions round
up to whole bytes, as Kubernetes does. Refused, with the spelling to use instead: a bare `m` (in Kubernetes it
means milli, a thousandth of a byte, never "mega"), `K`, `KB`/`MB`/`GiB`-style suffixes, signs and spaces
inside the number, and anything of 2^63 bytes or more (Kubernetes' own limit).
"""

from __future__ import annotations

import math
import re

from weightcache.errors import ConfigError

MAX_BYTES = (1 << 63) - 1
_MAX_TEXT = 64  # longer text is not a size; refuse it before any arithmetic
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)|[eE]([+-]?[0-9]{1,2}))?")
QUANTITY_PATTERN = _QUANTITY.pattern  # a size as text: the daemon config's JSON Schema says the same
_FACTORS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_BINARY = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_SI = ("", "k", "M", "G", "T", "P", "E")


def quantity(n: int) -> str:
    """A whole number the way the API server stores it (`resource.Quantity`'s canonical decimal form: the largest
    SI suffix that keeps the number whole), `5000000` -> `5M`, `1500` -> `1500`. What we send in this form comes
    back unchanged, so comparing the stored object with the one we would send does not see a change that is none."""
    if n < 0:
        raise ValueError(f"a quantity here is a count, not {n}")
    exp = 0
    while n and n % 1000 == 0 and exp < len(_SI) - 1:
        n, exp = n // 1000, exp + 1
    return f"{n}{_SI[exp]}"


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from an int or a Kubernetes quantity ("500Gi", "1.5T", "16Mi"); ConfigError names `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what}: expected a size such as 500Gi or a number of bytes, got {value!r}")
    if isinstance(value, int):
        return _checked(value, value, what)
    text = value.strip()
    match = _QUANTITY.fullmatch(text) if len(text) <= _MAX_TEXT else None
    if match is None:
        shown = repr(value) if len(text) <= _MAX_TEXT else f"a {len(text)}-character value"
        raise ConfigError(f"{what}: {shown} is not a size; {_hint(text)}")
    from decimal import Decimal  # here: most commands parse no size (the C module's load, 2-4 ms of every start)

    number, suffix, exponent = Decimal(match.group(1)), match.group(2) or "", match.group(3)
    exact = number * (Decimal(10) ** int(exponent) if exponent else _FACTORS[suffix])  # 28 digits: ample for 63 bits
    return _checked(math.ceil(exact) if exact <= MAX_BYTES else MAX_BYTES + 1, value, what)


def ascii_int(text: str) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits only, else None: str.isdigit() is also True for
    '²' or '٣', which int() then refuses or reads (a header, a port or a file name is untrusted text)."""
    return int(text) if text.isascii() and text.isdigit() else None


def fmt_bytes(n: int | float | None) -> str:
    """'512 B', '64 KiB', '1.25 GiB', '12.3 GiB', '931 GiB': binary units, three significant digits; None -> '?'."""
    if n is None:
        return "?"
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _BINARY:
        value /= 1024
        if abs(value) < 1024 or unit == _BINARY[-1]:
            break
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    text = f"{value:.{digits}f}"
    return (text.rstrip("0").rstrip(".") if digits else text) + f" {unit}"


def _checked(n: int, original: object, what: str) -> int:
    if n < 0:
        raise ConfigError(f"{what}: {original!r} is negative; a size is 0 or more bytes")
    if n > MAX_BYTES:
        raise ConfigError(f"{what}: {original!r} is too large; a size is less than 8Ei")
    return n


def _hint(text: str) -> str:
    number = text.rstrip("BbIi ").rstrip("kKmMgGtTpPeE")
    letter = text[len(number):len(number) + 1].upper()
    if text.endswith("m") and text[:-1].replace(".", "", 1).isdigit():
        return "a bare 'm' is milli (a thousandth of a byte) in Kubernetes; write M (10^6) or Mi (2^20)"
    if letter in "KMGTPE" and letter and number.replace(".", "", 1).isdigit():
        decimal = "k" if letter == "K" else letter
        return f"write {number}{decimal} (powers of 1000) or {number}{letter}i (powers of 1024)"
    return "write bytes or a Kubernetes quantity such as 500Gi, 64Mi, 1.5T or 4096"
