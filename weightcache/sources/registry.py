"""The OCI distribution API as both sides of weightcache speak it: `oci://` reads (sources/oci.py) and
`weightcache export` pushes (sources/oci_export.py).

One `RegistryClient` per registry and repository: where it is (https, or plain HTTP for a loopback or listed
host: `plain_http`), the credentials of the docker config file (`docker_credentials`), one `WWW-Authenticate`
challenge answered (Basic, or a Bearer token from the realm it names) and the answer kept for later requests,
redirects of GET and HEAD followed without credentials to other hosts and never from https to http. Every answer
of the registry and its token service is untrusted: bounded, checked, and its fields never echoed whole.
"""

from __future__ import annotations

import base64
import builtins
import ipaddress
import json
import logging
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urljoin, urlsplit

from weightcache.errors import SourceAccessDeniedError, SourceError, SourceNotFoundError
from weightcache.sources.base import Retryable, SourceOptions
from weightcache.sources.http import NETWORK_ERRORS, raise_for_status, read_capped

log = logging.getLogger(__name__)

INSECURE_ENV = "WEIGHTCACHE_OCI_INSECURE_REGISTRIES"
TOKEN_MAX = 1 << 20  # bytes of a token endpoint's answer
CONFIG_MAX = 1 << 20  # bytes of a docker config file
MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


class RegistryClient:
    """Requests to one repository of one registry, with its authorization."""

    def __init__(self, registry: str, repository: str, options: SourceOptions) -> None:
        self.registry = registry
        self.repository = repository
        self.options = options
        self.scheme = "http" if plain_http(registry) else "https"
        self.base = f"{self.scheme}://{registry}/v2/{repository}/"
        self._pool = options.http_pool()
        self.credentials = docker_credentials(registry)
        self._lock = threading.Lock()
        self._authorization: str | None = None  # what the registry's last challenge asked for

    def close(self) -> None:
        self._pool.clear()

    def url(self, location: str, base: str | None = None) -> str:
        """An absolute URL for a Location the registry sent (relative to `base`, default the repository's), which
        must stay on http(s) and never step down from https to http."""
        target = urljoin(base or self.base, location)
        if urlsplit(target).scheme not in ("http", "https") or not urlsplit(target).hostname or \
                (self.scheme == "https" and urlsplit(target).scheme != "https"):
            raise SourceError(f"{self.registry}: the registry points to {origin(target)[:100]!r}, refused")
        return target

    def request(self, method: str, url: str, what: str, *, headers: dict[str, str] | None = None,
                body: bytes | None = None, ok: tuple[int, ...] = (200,)) -> Any:
        """`method` `url` with the registry's authorization, answering one challenge (the body sent again) and,
        for GET and HEAD, following redirects (credentials only to the registry's own origin); the response whose
        status is in `ok`, body unread. 401, 403 and 404 outside `ok` are the access and not-found errors."""
        headers = headers or {}
        home = origin(url)
        for _ in range(MAX_REDIRECTS + 1):
            resp = self._authorized(method, url, headers, body, origin(url) == home)
            if resp.status in _REDIRECTS and method in ("GET", "HEAD") and resp.status not in ok:
                location = resp.headers.get("Location", "")
                resp.close()
                if not location:
                    raise SourceError(f"{what}: the registry redirects nowhere")
                url = self.url(location, url)
                continue
            if resp.status in ok:
                return resp
            if resp.status == 401:
                resp.close()
                raise SourceAccessDeniedError(
                    f"{what}: the registry {self.registry} refuses the credentials"
                    f"{'' if self.credentials else ' (none found)'}; put them in a docker config file "
                    f"($DOCKER_CONFIG/config.json or ~/.docker/config.json, `auths` for {self.registry})")
            if resp.status == 403:
                resp.close()
                raise SourceAccessDeniedError(f"{what}: the registry {self.registry} forbids it; check the "
                                              f"repository's permissions for these credentials")
            if resp.status == 404:
                resp.close()
                raise SourceNotFoundError(f"{what}: not in {self.registry}/{self.repository}; check the repository, "
                                          "tag or digest")
            raise_for_status(resp, what, ok, "check that this is an OCI registry")
            return resp
        raise SourceError(f"{what}: more than {MAX_REDIRECTS} redirects from {self.registry}; check that this is "
                          "an OCI registry")

    def _authorized(self, method: str, url: str, headers: dict[str, str], body: bytes | None,
                    authorize: bool) -> Any:
        """One request; `authorize`: the registry's own origin, where its authorization goes and a 401 is answered
        once."""
        sent = self._authorization if authorize else None
        resp = self.send(method, url, {**headers, **({"Authorization": sent} if sent else {})}, body)
        if resp.status != 401 or not authorize:
            return resp
        challenge = str(resp.headers.get("WWW-Authenticate", ""))
        resp.close()
        with self._lock:
            if self._authorization == sent:  # no other thread answered this challenge meanwhile
                self._authorization = self._answer(challenge)
            now = self._authorization
        return self.send(method, url, {**headers, **({"Authorization": now} if now else {})}, body)  # 401: refused

    def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> Any:
        try:
            return self._pool.request(method, url, headers=headers, body=body, preload_content=False,
                                      redirect=False)
        except NETWORK_ERRORS as exc:
            raise Retryable(f"{method} {origin(url)} failed ({type(exc).__name__})") from exc

    def _basic(self) -> str | None:
        if self.credentials is None:
            return None
        return "Basic " + base64.b64encode(":".join(self.credentials).encode()).decode()

    def _answer(self, challenge: str) -> str | None:
        """The Authorization a WWW-Authenticate challenge asks for: Basic with our credentials, or a Bearer token
        from the realm it names (with our credentials when we have them); None when we cannot answer."""
        scheme, _, params = challenge.strip().partition(" ")
        if scheme.lower() == "basic":
            return self._basic()
        if scheme.lower() != "bearer":
            return None
        headers = {"Accept": "application/json"}
        basic = self._basic()
        if basic is not None:
            headers["Authorization"] = basic
        resp = self.send("GET", self._token_url(dict(re.findall(r'([A-Za-z_]+)="([^"]*)"', params))), headers)
        if resp.status in (401, 403):
            resp.close()
            raise SourceAccessDeniedError(f"{self.registry}: its token service refuses the credentials"
                                          f"{'' if self.credentials else ' (none found)'}; put them in a docker "
                                          "config file ($DOCKER_CONFIG/config.json or ~/.docker/config.json)")
        raise_for_status(resp, f"the token service of {self.registry}", (200,), "check the registry's token service")
        return f"Bearer {self._token(read_capped(resp, TOKEN_MAX, 'a token'))}"

    def _token_url(self, fields: dict[str, str]) -> str:
        """The URL a Bearer challenge's fields (realm, service, scope) name, if it is one we may ask."""
        realm = fields.get("realm", "")
        parts = urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            raise SourceError(f"{self.registry}: the token realm {realm[:100]!r} is not a URL we may ask")
        if parts.scheme == "http" and not plain_http(parts.netloc):
            raise SourceError(f"{self.registry}: the token realm {origin(realm)[:100]!r} is plain HTTP; only a "
                              f"loopback or {INSECURE_ENV} host may be")
        query = {k: fields[k] for k in ("service", "scope") if fields.get(k)}
        return realm + ("&" if parts.query else "?") + urlencode(query) if query else realm

    def _token(self, answer_body: bytes) -> str:
        """The token of a token service's answer (`token` or `access_token`)."""
        if len(answer_body) > TOKEN_MAX:
            raise SourceError(f"{self.registry}: its token service answered over {TOKEN_MAX >> 20} MiB")
        try:
            answer = json.loads(answer_body)
        except (ValueError, RecursionError):
            answer = None
        token = answer.get("token") or answer.get("access_token") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not re.fullmatch(r"[A-Za-z0-9._~+/=-]{1,8192}", token):
            raise SourceError(f"{self.registry}: its token service gave no usable token")
        return token


# -- where and how ---------------------------------------------------------------------------------------------
def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}"


def _host(netloc: str) -> str:
    """The host of host[:port] (brackets of an IPv6 literal dropped), lowercase."""
    if netloc.startswith("["):
        return netloc[1:].partition("]")[0].lower()
    return netloc.rpartition(":")[0].lower() if netloc.count(":") == 1 else netloc.lower()


def plain_http(netloc: str) -> bool:
    """True for a registry spoken to over plain HTTP: a loopback address, or one listed in INSECURE_ENV."""
    host = _host(netloc)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    listed = {x.strip().lower() for x in re.split(r"[,\s]+", os.environ.get(INSECURE_ENV, "")) if x.strip()}
    return netloc.lower() in listed or host in listed


def docker_config_files() -> builtins.list[Path]:
    """Where credentials are read, first found wins: $DOCKER_CONFIG (a directory with config.json, or a mounted
    kubernetes.io/dockerconfigjson secret's .dockerconfigjson; or that file itself), else ~/.docker/config.json."""
    env = os.environ.get("DOCKER_CONFIG")
    if env:
        path = Path(env)
        return [path] if path.is_file() else [path / "config.json", path / ".dockerconfigjson"]
    return [Path.home() / ".docker" / "config.json"]


def docker_credentials(registry: str) -> tuple[str, str] | None:
    """(user, password) for `registry` from the docker config, in docker's order: the credential helper
    `credHelpers` names for it, else its `auths` entry (`auth`: base64 user:password, or `username` + `password`),
    else the `credsStore` helper; None when there are none."""
    for path in docker_config_files():
        try:
            with path.open("rb") as f:
                body = f.read(CONFIG_MAX + 1)
        except OSError:
            continue
        try:
            doc = json.loads(body) if len(body) <= CONFIG_MAX else None
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            log.warning("%s is not a docker config file (JSON with `auths`); no registry credentials from it", path)
            return None
        helpers = doc.get("credHelpers")
        for key, name in (helpers.items() if isinstance(helpers, dict) else ()):
            if isinstance(key, str) and _auth_key(key) == registry.lower():
                return helper_credentials(name, registry)
        auths = doc.get("auths", doc)  # a legacy .dockercfg is the auths map itself
        for key, entry in (auths.items() if isinstance(auths, dict) else ()):
            if (isinstance(key, str) and isinstance(entry, dict) and _auth_key(key) == registry.lower()
                    and (found := _entry_credentials(entry, path)) is not None):
                return found
        store = doc.get("credsStore")
        return helper_credentials(store, registry) if store else None
    return None


HELPER_TIMEOUT = 30.0  # seconds a credential helper may take (ECR's and GAR's ask their cloud's token service)
_HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def helper_credentials(name: object, registry: str) -> tuple[str, str] | None:
    """`docker-credential-<name> get` with the registry on stdin (the docker-credential-helpers protocol: ECR's,
    GAR's `gcloud`, `pass`, `secretservice`): {"Username", "Secret"} on stdout. An identity token (Username
    `<token>`: ACR's) would need an OAuth2 exchange with the registry, which is not done: None, with a warning.
    The helper's output never reaches a message (it holds the secret)."""
    if not isinstance(name, str) or not _HELPER_NAME.fullmatch(name):
        log.warning("docker config names credential helper %r: not a helper name; no credentials from it",
                    str(name)[:80])
        return None
    program = shutil.which(f"docker-credential-{name}")
    if program is None:
        log.warning("docker config names credential helper %r, but docker-credential-%s is not on PATH; "
                    "install it, or log in with `auths` credentials", name, name)
        return None
    try:
        done = subprocess.run([program, "get"], input=registry.encode(), capture_output=True,
                              timeout=HELPER_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("docker-credential-%s get for %s failed (%s); no credentials from it", name, registry,
                    type(exc).__name__)
        return None
    if done.returncode:  # "credentials not found": the registry is then asked without any
        log.info("docker-credential-%s has no credentials for %s (exit %d)", name, registry, done.returncode)
        return None
    try:
        answer = json.loads(done.stdout[:CONFIG_MAX])
        user, secret = answer["Username"], answer["Secret"]
    except (ValueError, RecursionError, KeyError, TypeError):
        log.warning("docker-credential-%s get for %s: not JSON with Username and Secret; ignored", name, registry)
        return None
    if not isinstance(user, str) or not isinstance(secret, str) or not user:
        return None
    if user == "<token>":
        log.warning("docker-credential-%s gives %s an identity token, which weightcache cannot exchange; use a "
                    "username and password or token in the docker config's `auths`", name, registry)
        return None
    return user, secret


def _auth_key(key: str) -> str:
    """`https://host:port/v1/` or `host:port` -> `host:port`; Docker Hub's index names docker.io."""
    netloc = key.partition("://")[2] if "://" in key else key
    netloc = netloc.partition("/")[0].lower()
    return "docker.io" if netloc in ("index.docker.io", "registry-1.docker.io") else netloc


def _entry_credentials(entry: dict[str, Any], path: Path) -> tuple[str, str] | None:
    auth, user, password = entry.get("auth"), entry.get("username"), entry.get("password")
    if isinstance(auth, str) and auth:
        try:
            user, _, password = base64.b64decode(auth, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            log.warning("%s: an `auth` entry is not base64 of user:password; ignored", path)
            return None
    if isinstance(user, str) and isinstance(password, str) and user:
        return user, password
    return None


__all__ = ["INSECURE_ENV", "NETWORK_ERRORS", "RegistryClient", "docker_credentials", "origin", "plain_http"]
