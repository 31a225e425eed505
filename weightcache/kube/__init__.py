"""Kubernetes layer: ModelCache watch, desired-state selection, node labels, per-node status, Events, cluster CLI.

Resources (`weightcache.io/v1alpha1`, both cluster-scoped; CRDs in deploy/daemonset/):

    ModelCache/<name>          desired state, written by people and `weightcache prefetch --cluster`
    ModelCacheNode/<node>      observed state of ONE node, written only by that node's daemon:
                               status.models[<ModelCache name>] = {phase, bytesDone, bytesTotal, snapshot, ...}

One writer per object means no write contention at 1,000 nodes; the node label `weightcache.io/m<hash>=ready`
is what the scheduler and the webhook's node affinity read.
"""

import re

GROUP = "weightcache.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MODELCACHES = "modelcaches"
MODELCACHE_KIND = "ModelCache"
MODELCACHENODES = "modelcachenodes"
MODELCACHENODE_KIND = "ModelCacheNode"

_MESSAGE_MAX = 1024  # events.k8s.io caps a note at 1 kB; keep status messages to the same size

_SECRETS = [
    (re.compile(r"(?i)([a-z][a-z0-9+.-]*://)[^/\s@]*@"), r"\1***@"),  # userinfo in URLs
    (re.compile(r"(?i)((?:x-amz-(?:signature|credential|security-token)|sig|signature|token|access_token|sv|se)=)[^&\s]+"), r"\1***"),
    (re.compile(r"(?i)((?:aws_secret_access_key|aws_session_token|secret|password|passwd)\s*[=:]\s*)\S+"), r"\1***"),
    (re.compile(r"(?i)(authorization\s*[:=]\s*)(?:bearer|basic|aws4-hmac-sha256)?\s*\S+"), r"\1***"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "***"),
]


def redact(text: str) -> str:
    """Strip credentials that error texts from object stores are known to carry (URL userinfo, signed-URL
    parameters, access key ids, Authorization values), and cap the length."""
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text if len(text) <= _MESSAGE_MAX else text[: _MESSAGE_MAX - 3] + "..."
