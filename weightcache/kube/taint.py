"""Removing one taint from a Node without touching the others.

Node `spec.taints` has no patch merge key (k8s.io/api core/v1 NodeSpec.Taints): a merge or strategic merge patch
replaces the list whole, so a daemon that read the list, dropped its taint and wrote the rest
back would erase a taint another controller added in between (the node lifecycle controller's `not-ready`, a
GPU operator's). The write here is an RFC 6902 JSON patch that first `test`s the list it read, exactly as the API
server serves it, then replaces it with that list minus the one taint:

    [{"op": "test",    "path": "/spec/taints", "value": [<the taints as read>]},
     {"op": "replace", "path": "/spec/taints", "value": [<the same, without KEY:EFFECT>]}]

The API server applies a JSON patch to the object as stored now (handlers/patch.go `applyJSPatch`) and answers a
failed `test` with 422 Invalid; then the list changed under us, and we read it again and retry. The Node is read
raw (JSON, not the client's models) so the `test` value is byte for byte what the server compares against: a
model round trip could re-format a taint's `timeAdded`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from weightcache.errors import ClusterError

log = logging.getLogger(__name__)

JSON_PATCH = "application/json-patch+json"
ATTEMPTS = 5  # each lost race is another controller's write to the same list: a handful settles it


def read_node(api_client: kubernetes.client.ApiClient, name: str) -> dict[str, Any]:
    """The Node as the API server serves it (JSON), for a `test` that compares what the server compares."""
    core = kubernetes.client.CoreV1Api(api_client)
    try:
        response = core.read_node(name, _preload_content=False)
        node = json.loads(response.data)
    except ApiException as exc:
        raise ClusterError(f"reading Node {name} failed: HTTP {exc.status} {exc.reason}; check the daemon's RBAC "
                           "(deploy/daemonset/rbac.yaml) and the API server", status=exc.status or 0) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise ClusterError(f"reading Node {name} failed: API server unreachable ({type(exc).__name__})") from exc
    except ValueError as exc:
        raise ClusterError(f"reading Node {name} failed: the API server's answer is not JSON") from exc
    if not isinstance(node, dict):
        raise ClusterError(f"reading Node {name} failed: the API server's answer is not an object")
    return node


def taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    spec = node.get("spec")
    found = spec.get("taints") if isinstance(spec, dict) else None
    return [t for t in found if isinstance(t, dict)] if isinstance(found, list) else []


def has_taint(node: dict[str, Any], key: str, effect: str) -> bool:
    return any(t.get("key") == key and t.get("effect") == effect for t in taints(node))


def remove_taint(api_client: kubernetes.client.ApiClient, name: str, key: str, effect: str) -> bool:
    """Remove `key:effect` from Node `name`, keeping every other taint. True when this call removed it, False
    when the Node no longer had it. ClusterError when the API refuses (RBAC, node-policy.yaml) or the list kept
    changing under us for ATTEMPTS reads."""
    core = kubernetes.client.CoreV1Api(api_client)
    for _ in range(ATTEMPTS):
        node = read_node(api_client, name)
        if not has_taint(node, key, effect):
            return False
        current = (node.get("spec") or {}).get("taints")
        keep = [t for t in taints(node) if not (t.get("key") == key and t.get("effect") == effect)]
        patch = [{"op": "test", "path": "/spec/taints", "value": current},
                 {"op": "replace", "path": "/spec/taints", "value": keep}]
        try:
            core.patch_node(name, patch, _content_type=JSON_PATCH)
            return True
        except ApiException as exc:
            if exc.status != 422:  # 422: the `test` failed, the list changed since we read it
                raise ClusterError(f"removing taint {key}:{effect} from Node {name} failed: HTTP {exc.status} "
                                   f"{exc.reason}; check the daemon's RBAC and deploy/daemonset/node-policy.yaml",
                                   status=exc.status or 0) from exc
            log.info("the taints of Node %s changed while removing %s; reading them again", name, key)
        except urllib3.exceptions.HTTPError as exc:
            raise ClusterError(f"removing taint {key} from Node {name} failed: API server unreachable "
                               f"({type(exc).__name__})") from exc
    raise ClusterError(f"removing taint {key}:{effect} from Node {name}: its taints changed {ATTEMPTS} times in a "
                       "row; retried at the next reconcile pass")
