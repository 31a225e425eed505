"""Find the cluster: in-cluster service account first, then KUBECONFIG / ~/.kube/config, else off-cluster (None).

The one door to the official client: only `weightcache.kube` imports `kubernetes` (import-linter's gateway
contract), so the rest of weightcache takes the API classes and `ApiException` from here.

A kubeconfig that exists but cannot be loaded is an error, not "off-cluster": silently dropping to off-cluster
would also drop the namespace policy that cluster mode enforces. Nothing here logs tokens or certificates.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import kubernetes
from kubernetes.client import (
    ApiClient,
    ApiException,
    CoordinationV1Api,
    CoreV1Api,
    CustomObjectsApi,
    V1DeleteOptions,
    V1Preconditions,
    VersionApi,
)

from weightcache.errors import ConfigError
from weightcache.kube import kubeconfig_paths

__all__ = ["ApiClient", "ApiException", "CoordinationV1Api", "CoreV1Api", "CustomObjectsApi", "V1DeleteOptions",
           "V1Preconditions", "VersionApi", "api_reason", "in_cluster", "load_api_client", "status_message"]

log = logging.getLogger(__name__)


def status_message(exc: ApiException) -> str:
    """The API server's own reason (the `Status` body's message, whole), never the raw response: it has headers."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def api_reason(exc: BaseException) -> str:
    """A failed API call, for a log line: `HTTP 422: <the server's whole message>`, or the transport error."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {status_message(exc)}"
    return f"{type(exc).__name__}: {exc}"

def in_cluster() -> bool:
    """True inside a pod with a service account (the same test the official client's in-cluster loader makes)."""
    token = Path(kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME)
    env = os.environ
    return bool(env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT")) and token.is_file()


def load_api_client() -> ApiClient | None:
    """An ApiClient for the cluster this process belongs to, or None when no Kubernetes config exists."""
    config = kubernetes.client.Configuration()
    if in_cluster():
        kubernetes.config.load_incluster_config(client_configuration=config)
        log.info("cluster mode: in-cluster service account, API server %s", config.host)
        return ApiClient(config)
    paths = [p for p in kubeconfig_paths() if p.is_file()]
    if not paths:
        log.debug("no kubeconfig found; off-cluster mode")
        return None
    try:
        kubernetes.config.load_kube_config(config_file=os.pathsep.join(map(str, paths)), client_configuration=config)
    except (kubernetes.config.ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
        # The loader names keys and files, not secret values; keep only its first line anyway.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"kubeconfig {os.pathsep.join(map(str, paths))} could not be loaded ({reason}); fix it "
            "(check `kubectl config view`) or unset KUBECONFIG to run off-cluster"
        ) from exc
    log.info("cluster mode: kubeconfig, API server %s", config.host)
    return ApiClient(config)
