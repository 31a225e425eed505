"""Model references: `SCHEME://bucket/prefix/[@revision]` plus include/exclude globs.

A reference names every object under a prefix. It is parsed once, validated without any I/O, and carried as a
frozen value. Two strings that mean the same model canonicalise to the same `uri`, so the store, the labels
and the policy agree on identity:

    s3://models/llama-3-8b/@3f2a...      -> scheme s3, bucket models, prefix "llama-3-8b/", revision "3f2a..."
    file:///srv/models/llama/            -> scheme file, bucket "", prefix "/srv/models/llama/"
    https://host:8080/models/llama/      -> scheme https, bucket "host:8080", prefix "models/llama/"

Credentials never belong in a reference (`https://user:pw@host/` is refused): they come from the environment.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass

from weightcache.errors import InvalidReferenceError
from weightcache.redact import redact
from weightcache.vocabulary import READINESS_LABEL_PREFIX

SCHEMES = ("s3", "gs", "az", "http", "https", "file", "memory", "hf", "oci")
EXAMPLE = "s3://models/llama-3-8b/ (optionally s3://models/llama-3-8b/@<revision>)"

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]$")
_HOST = re.compile(r"^(?:[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")  # host[:port], never user:secret
_HF_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")  # hub org or repo name
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")
# oci:// (the distribution spec's grammar): repository path components, a tag, a sha256 digest
_OCI_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# what model_key returns, written once: is_model_key, the readiness label and DRA's fetchable device names use it
MODEL_KEY_PATTERN = r"m[0-9a-f]{20}"
_MODEL_KEY = re.compile(MODEL_KEY_PATTERN)


@dataclass(frozen=True)
class ModelRef:
    """A parsed, validated model reference."""

    scheme: str
    bucket: str
    prefix: str
    revision: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def uri(self) -> str:
        """Canonical URI without revision: the model's identity across store, labels and policy."""
        if self.scheme == "file":
            return f"file://{self.prefix}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def key(self) -> str:
        """Short stable hash of the model's identity (uri + globs); safe as a path part and a label name."""
        return model_key(self.uri, self.include, self.exclude)

    @property
    def label_key(self) -> str:
        """Node label the daemon sets when this selection of the model is ready there (`weightcache.io/<key>`)."""
        return readiness_label(self)

    def matches(self, relpath: str) -> bool:
        """True when a path relative to the prefix passes the include and exclude globs."""
        if self.include and not any(fnmatch.fnmatchcase(relpath, g) for g in self.include):
            return False
        return not any(fnmatch.fnmatchcase(relpath, g) for g in self.exclude)

    def __str__(self) -> str:
        if self.scheme == "oci":  # oci://registry/repository:tag or @sha256:<hex>; no revision: the tag latest
            sep = "@" if self.revision and OCI_DIGEST.fullmatch(self.revision) else ":"
            return self.uri.rstrip("/") + (f"{sep}{self.revision}" if self.revision else "")
        return self.uri + (f"@{self.revision}" if self.revision else "")


def model_key(uri: str, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> str:
    """`m` + 20 hex digits of sha256 over the canonical uri and globs (fits DNS labels and label names)."""
    import hashlib  # here: the CLI's path through the daemon never needs it (OpenSSL's libcrypto, 3-8 ms)

    material = "\0".join([uri, *sorted(include), "\0", *sorted(exclude)])
    return "m" + hashlib.sha256(material.encode()).hexdigest()[:20]


def is_model_key(value: str) -> bool:
    """Whether `value` is what model_key returns (a name read back from the store's directories may be anything)."""
    return _MODEL_KEY.fullmatch(value) is not None


_READINESS_LABEL = re.compile(re.escape(READINESS_LABEL_PREFIX) + MODEL_KEY_PATTERN)


def readiness_label(ref: ModelRef | str) -> str:
    """The node label key for a model's selection: one function for the daemon, the webhook and the controller.

    It hashes the globs with the URI (`ref.key`): a node holding only `include: [config.json]` of a model must
    not look ready to a pod that wants all of it. A string is a reference without globs."""
    return READINESS_LABEL_PREFIX + (ref if isinstance(ref, ModelRef) else parse_ref(ref)).key


def is_readiness_label(key: str) -> bool:
    """True for exactly the keys `readiness_label` makes: the daemon removes stale ones of these and no other
    label (an operator's `weightcache.io/memory-pool` shares the prefix)."""
    return bool(_READINESS_LABEL.fullmatch(key))


def canonical_uri(text: str) -> str:
    """Canonical form of a reference string, ignoring any revision."""
    return parse_ref(text).uri


def parse_globs(text: str, field: str) -> tuple[str, ...]:
    """A glob list as a volume attribute or annotation carries it: a JSON list of strings
    (`["*.safetensors", "*.json"]`) or comma-separated (`*.safetensors,*.json`); empty means none."""
    text = text.strip()
    if not text:
        return ()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
            value = None
        if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
            raise InvalidReferenceError(f"{field} {redact(text)[:100]!r} is not a JSON list of strings; write it "
                                        f'like ["*.safetensors", "*.json"] or *.safetensors,*.json')
        globs = [g.strip() for g in value]
    else:
        globs = [g.strip() for g in text.split(",")]
    globs = [g for g in globs if g]
    for glob in globs:
        if "\0" in glob or glob.startswith("/"):
            raise InvalidReferenceError(redact(f"{field}: glob {glob!r} must be a relative pattern such as "
                                               "'*.safetensors'"))
    return tuple(globs)


def _fail(text: str, why: str) -> InvalidReferenceError:
    # `why` may quote a piece of `text` (a bucket that is really `key:secret`): redact the whole message
    return InvalidReferenceError(redact(f"invalid model reference {text!r}: {why}; write it like {EXAMPLE}"))


def parse_ref(
    text: str,
    *,
    revision: str | None = None,
    include: tuple[str, ...] | list[str] = (),
    exclude: tuple[str, ...] | list[str] = (),
) -> ModelRef:
    """Parse and validate a reference; `revision` (a flag) wins over an `@revision` suffix."""
    text, scheme, rest = _split_scheme(text)
    if scheme == "oci":
        bucket, path, rev = _parse_oci(text, rest, revision)
    else:
        bucket, path, rev = _parse_path(text, scheme, rest, revision)
    for glob in (*include, *exclude):
        if not glob or "\0" in glob or glob.startswith("/"):
            raise _fail(text, f"glob {glob!r} must be a non-empty relative pattern such as '*.safetensors'")
    return ModelRef(scheme, bucket, path, rev, tuple(include), tuple(exclude))


def _split_scheme(text: str) -> tuple[str, str, str]:
    """(the reference stripped, its scheme in lowercase, what follows `://`)."""
    if not isinstance(text, str) or not text.strip():
        raise _fail(str(text), "it is empty")
    text = text.strip()
    if "\0" in text or any(ord(c) < 0x20 for c in text):
        raise _fail(text, "it contains control characters")
    scheme, sep, rest = text.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise _fail(text, "it has no scheme")
    if scheme not in SCHEMES:
        raise _fail(text, f"unknown scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    return text, scheme, rest


def _parse_path(text: str, scheme: str, rest: str, revision: str | None) -> tuple[str, str, str | None]:
    """`bucket/prefix[@revision]` (file: `/path[@revision]`) -> (bucket, "prefix/", revision or None); `revision`
    (a flag) wins."""
    if scheme == "file":
        bucket, path = "", rest
        if not path.startswith("/"):
            raise _fail(text, "file:// needs an absolute path, as in file:///srv/models/llama/")
    else:
        bucket, _, path = rest.partition("/")
        if "@" in bucket:
            raise _fail(text, "credentials or '@' in the host part are not allowed; use the environment's credentials")
    rev_from_text = None
    if "@" in path:
        path, _, rev_from_text = path.rpartition("@")
        if not rev_from_text:
            raise _fail(text, "'@' must be followed by a revision")
        if "@" in path:  # the canonical form without its revision would read the last '@' as one
            raise _fail(text, "'@' may appear once, before the revision; a prefix with '@' in it cannot be named")
    rev = revision or rev_from_text or None
    if rev is not None and not _REVISION.fullmatch(rev):
        raise _fail(text, f"revision {rev!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    _check_bucket(text, scheme, bucket)
    return bucket, _normalise_path(text, scheme, path), rev


def _parse_oci(text: str, rest: str, revision: str | None) -> tuple[str, str, str | None]:
    """`registry[:port]/repository[:tag|@sha256:<hex>]` (also `repository/@revision`, the form `uri@revision`
    makes) -> (registry, "repository/", tag or digest or None); `revision` (a flag) wins."""
    bucket, _, path = rest.partition("/")
    if "@" in bucket:
        raise _fail(text, "credentials or '@' in the registry part are not allowed; use a docker config file")
    if not bucket or not _HOST.fullmatch(bucket):
        raise _fail(text, f"registry {bucket!r} is not a valid host[:port]; write oci://registry/repository:tag")
    rev: str | None = None
    if "@" in path:
        path, _, rev = path.partition("@")
        if not OCI_DIGEST.fullmatch(rev) and not (path.endswith("/") and _OCI_TAG.fullmatch(rev)):
            raise _fail(text, f"{rev[:80]!r} after '@' is not a digest sha256:<64 lowercase hex>")
    last = path.rstrip("/").rpartition("/")[2]
    if ":" in last and not path.endswith("/"):
        path, _, tag = path.rpartition(":")
        if not _OCI_TAG.fullmatch(tag):
            raise _fail(text, f"tag {tag[:80]!r} must be 1-128 characters of letters, digits, '_', '.', '-'")
        rev = rev or tag  # repository:tag@digest: the digest names the content
    parts = path.strip("/").split("/")
    if not path.strip("/") or not all(_OCI_COMPONENT.fullmatch(p) for p in parts) or len(path) > 255:
        raise _fail(text, "the repository must be lowercase path components (a-z, 0-9, separated by '.', '_', "
                          "'__' or '-'), at most 255 characters; write oci://registry/repository:tag")
    if revision is not None:
        if not (OCI_DIGEST.fullmatch(revision) or _OCI_TAG.fullmatch(revision)):
            raise _fail(text, f"revision {revision[:80]!r} is neither a tag nor a digest sha256:<64 lowercase hex>")
        rev = revision
    return bucket, "/".join(parts) + "/", rev


def _check_bucket(text: str, scheme: str, bucket: str) -> None:
    if scheme in ("s3", "gs", "az"):
        if not _BUCKET.fullmatch(bucket):
            raise _fail(text, f"bucket {bucket!r} is not a valid bucket name")
    elif scheme in ("http", "https"):
        if not bucket or not _HOST.match(bucket):
            raise _fail(text, f"host {bucket!r} is not a valid host[:port]")
    elif scheme == "hf" and (not _HF_PART.fullmatch(bucket) or "--" in bucket or ".." in bucket):
        raise _fail(text, f"{bucket!r} is not a Hugging Face org or repo name; write hf://org/name[@revision]")
    elif scheme == "memory" and bucket and not _BUCKET.fullmatch(bucket):
        raise _fail(text, f"memory root {bucket!r} is not a valid name")


def _normalise_path(text: str, scheme: str, path: str) -> str:
    """A prefix is a directory: always ends with '/', has no '.', '..' or empty segments inside."""
    lead = "/" if scheme == "file" else ""
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _fail(text, "'.' and '..' are not allowed in the prefix")
    if "?" in path or "#" in path:
        raise _fail(text, "query strings and fragments are not allowed")
    if not parts:
        return lead
    return lead + "/".join(parts) + "/"


# The hub's rule for repo ids (huggingface_hub.utils.validate_repo_id): an optional namespace, a name of at most
# 96 characters from [A-Za-z0-9._-], no "--" or ".." anywhere, not starting or ending with "-" or ".". Here, not in
# hf_layout, so the webhook and the sources check an hfRepo without importing the store.
_HF_REPO_ID = re.compile(r"(?:{p}/)?{p}".format(p=_HF_PART.pattern.strip("^$")))


def validate_repo_id(repo_id: str) -> str:
    """`org/name` as the hub accepts it; InvalidReferenceError says what is wrong."""
    if not _HF_REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        raise InvalidReferenceError(f"hfRepo {repo_id[:200]!r} is not a Hugging Face repo id such as "
                                    f"meta-llama/Llama-3.1-8B (letters, digits, '.', '_', '-'; no '--' or '..')")
    return repo_id
