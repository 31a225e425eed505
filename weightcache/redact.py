"""The one place credentials are taken out of text: every error message, log line, event and metric label.

References are parsed, not pattern-matched. Each `scheme://...` token in a text is split into authority,
path, revision and query the way weightcache reads references (weightcache/uri.py), and:

- userinfo (`user:secret@`) is replaced by `***`, even when the secret holds `/`, `@`, `:` or `%`
  (`s3://AKIA...:wJalr/K7MDENG/x@models/x/` -> `s3://***@models/x/`); the userinfo's pieces, raw and
  percent-decoded, are then blanked wherever else the text repeats them (a bucket-name error quoting half of it);
- the values of signed-URL query parameters (`X-Amz-Signature`, `sig`, `token`, ...) become `***`.

Outside references, `Authorization:` values and `aws_secret_access_key=`-style assignments are blanked.
Over-redacting a harmless word is preferred to leaking a key.

Log lines are redacted by the handlers our entry points install (weightcache/redact_logs.py: `RedactingFormatter`,
`redact_log_handlers`): importing the package changes no global logging state, so an embedding application keeps its
own factory and handlers, while every line a weightcache process writes (botocore's and urllib3's included) passes
`redact`. This module does not import logging: the CLI's prefetch through the daemon reads references (uri.py) and
progress (progress.py) through it and logs nothing, and logging's import was 5-9 ms of that client's start.
"""

from __future__ import annotations

from urllib.parse import unquote

SECRET_PARAMS = frozenset({
    "x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature", "x-goog-credential",
    "signature", "sig", "token", "access_token", "password", "secret", "key", "code",
})
SECRET_NAMES = ("authorization", "aws_secret_access_key", "aws_session_token", "secret_access_key",
                "password", "passwd", "secret", "token",
                "accountkey", "sharedaccesssignature")  # an Azure connection string's
MASK = "***"
_TOKEN_END = frozenset(" \t\r\n'\"<>`")
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_MIN_PIECE = 4  # shorter userinfo pieces are not searched for elsewhere in the text (too many false hits)


def redact(text: str, *, limit: int | None = None) -> str:
    """`text` without credentials; cut to `limit` characters (with "...") when given."""
    text = str(text)
    pieces: set[str] = set()
    out: list[str] = []
    pos = 0
    while (mark := text.find("://", pos)) >= 0:
        start = mark
        while start > pos and text[start - 1] in _SCHEME_CHARS:
            start -= 1
        end = mark + 3
        while end < len(text) and text[end] not in _TOKEN_END:
            end += 1
        clean, found = _redact_url(text[start:mark], text[mark + 3:end])
        out += [text[pos:start], clean]
        pieces |= found
        pos = end
    out.append(text[pos:])
    result = _blank_assignments("".join(out))
    for piece in sorted(pieces, key=len, reverse=True):
        result = result.replace(piece, MASK)
    if limit is not None and len(result) > limit:
        result = result[: max(0, limit - 3)] + "..."
    return result


def _redact_url(scheme: str, rest: str) -> tuple[str, set[str]]:
    """One reference token (`rest` follows `scheme://`): the safe text and the secret pieces it held."""
    pieces: set[str] = set()
    end = _userinfo_end(rest)
    if end is not None:
        userinfo = rest[:end]
        pieces = {p for p in _pieces(userinfo) if len(p) >= _MIN_PIECE}
        rest = MASK + rest[end:]
    base, sep, query = rest.partition("?")
    if sep:
        query, hsep, fragment = query.partition("#")
        parts = []
        for item in query.split("&"):
            name, eq, value = item.partition("=")
            if eq and unquote(name).lower() in SECRET_PARAMS and value:
                pieces |= {p for p in (value, unquote(value)) if len(p) >= _MIN_PIECE}
                item = f"{name}={MASK}"
            parts.append(item)
        rest = base + "?" + "&".join(parts) + (hsep + fragment)
    return f"{scheme}://{rest}", pieces


def _userinfo_end(rest: str) -> int | None:
    """Index of the '@' that ends a userinfo in `rest`, or None when every '@' is a revision marker.

    A revision is the one '@' of a reference, followed by letters, digits, '.', '_' or '-' only, in a reference
    whose first segment is a bucket or host[:port]. Any other '@' ends a userinfo: after `key:secret` the last
    '@'; otherwise the last '@' followed by a path, else the last '@'."""
    ats = [i for i, c in enumerate(rest) if c == "@" and (rest[i + 1:i + 2].isalnum() or rest[i + 1:i + 2] == "[")]
    if not ats:  # an '@' a host cannot follow (`s3://m/x/@<revision>`) ends no userinfo
        return None
    tail = rest[ats[-1] + 1:]
    colon = _has_credential_colon(rest.split("/", 1)[0])
    if len(ats) == 1 and _is_revision(tail) and not colon:
        return None
    if colon:  # `key:secret...`: everything up to the last '@' (a revision after it is hidden too: safe side)
        return ats[-1]
    with_path = [i for i in ats if "/" in rest[i + 1:].split("?", 1)[0]]
    return with_path[-1] if with_path else ats[-1]


def _is_revision(tail: str) -> bool:
    return bool(tail) and len(tail) <= 128 and tail[0].isalnum() and all(c.isalnum() or c in "._-" for c in tail)


def _has_credential_colon(segment: str) -> bool:
    """`host:8080` and `[::1]:8080` are hosts; `AKIA...:secret` is not."""
    if segment.startswith("["):
        segment = segment.partition("]")[2]
    if ":" not in segment:
        return False
    port = segment.rpartition(":")[2]
    return not (port.isdigit() and segment.count(":") == 1)


def _pieces(userinfo: str) -> set[str]:
    """The userinfo, its decoded form, and each part between ':', '/' and '@' (raw and decoded)."""
    found = {userinfo, unquote(userinfo)}
    for sep in (":", "/", "@"):
        for item in list(found):
            found |= set(item.split(sep))
    return {p for p in found | {unquote(p) for p in found} if p}


def _blank_assignments(text: str) -> str:
    """`Authorization: Bearer x`, `aws_secret_access_key = x`, `password=x` -> the name with `***`."""
    lower = text.lower()
    spans: list[tuple[int, int]] = []
    for name in SECRET_NAMES:
        start = 0
        while (i := lower.find(name, start)) >= 0:
            start = i + len(name)
            j = _skip_blanks(text, start)
            if j >= len(text) or text[j] not in ":=":
                continue
            j = _skip_blanks(text, j + 1)
            if name == "authorization":  # keep the scheme word (Bearer, Basic, AWS4-HMAC-SHA256)
                word_end = _word_end(text, j)
                if text[j:word_end].lower() in ("bearer", "basic", "aws4-hmac-sha256"):
                    j = _skip_blanks(text, word_end)
            end = _word_end(text, j)
            if end > j:
                spans.append((j, end))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    for lo, hi in reversed(merged):
        text = text[:lo] + MASK + text[hi:]
    return text


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t":
        i += 1
    return i


def _word_end(text: str, start: int) -> int:
    end = start
    while end < len(text) and text[end] not in " \t\r\n,;'\"&":
        end += 1
    return end


MESSAGE_CHARS = 2048  # gRPC drops a status whose details outgrow the 16 KiB metadata limit (RESOURCE_EXHAUSTED)


def shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` cut in the middle to at most about `limit` characters: a hostile field echoed in a message must
    neither replace the answer by a transport error nor fill the log."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}...({len(text) - 2 * half} characters left out)...{text[-half:]}"
