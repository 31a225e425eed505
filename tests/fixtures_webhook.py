"""Pods and AdmissionReviews as the API server builds them, and the API server's own checks on a patched Pod.

A Deployment's pod reaches a mutating webhook after the ReplicaSet controller filled it from the template
(`generateName`, no name, ownerReferences, pod-template-hash) and after the built-in admission plugins
(ServiceAccount: the kube-api-access projected volume and its mounts; DefaultTolerationSeconds) and defaulting
ran: every container has terminationMessagePath, imagePullPolicy, and so on. The review carries `dryRun`,
`options` (CreateOptions) and `userInfo` of the ReplicaSet controller.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Mapping
from typing import Any

import jsonpatch

from tests.fixtures_k8s_schema import validate_strict
from weightcache.webhook.mutate import API_VERSION

REF = "s3://models/llama-3-8b/"
DRAFT = "s3://models/llama-draft/@v2"


def container(name: str, image: str = "vllm/vllm-openai:v0.6.3", **extra: Any) -> dict[str, Any]:
    """A defaulted container with the ServiceAccount token mount the API server added."""
    c: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "4", "memory": "32Gi"}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "volumeMounts": [
            {
                "name": "kube-api-access-7xq2p",
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                "readOnly": True,
            }
        ],
    }
    c.update(extra)
    return c


def deployment_pod(
    annotations: Mapping[str, str] | None = None,
    *,
    containers: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
    affinity: dict[str, Any] | None = None,
    extra_volumes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A pod as a Deployment's ReplicaSet creates it, defaulted, before mutating webhooks run."""
    spec: dict[str, Any] = {
        "containers": containers
        if containers is not None
        else [container("server", ports=[{"containerPort": 8000, "name": "http", "protocol": "TCP"}])],
        "dnsPolicy": "ClusterFirst",
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
        "priority": 0,
        "restartPolicy": "Always",
        "schedulerName": "default-scheduler",
        "securityContext": {},
        "serviceAccount": "default",
        "serviceAccountName": "default",
        "terminationGracePeriodSeconds": 30,
        "tolerations": [
            {
                "effect": "NoExecute",
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "tolerationSeconds": 300,
            },
            {
                "effect": "NoExecute",
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "tolerationSeconds": 300,
            },
        ],
        "volumes": [
            *(extra_volumes or []),
            {
                "name": "kube-api-access-7xq2p",
                "projected": {
                    "defaultMode": 420,
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ],
                },
            },
        ],
    }
    if init_containers is not None:
        spec["initContainers"] = init_containers
    if affinity is not None:
        spec["affinity"] = affinity
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "llama-7d9f8c6b5-",
            "namespace": "inference",
            "labels": {"app": "llama", "pod-template-hash": "7d9f8c6b5"},
            "annotations": dict(annotations or {}),
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "llama-7d9f8c6b5",
                    "uid": "5b0f6a52-6f3e-4f0e-9c1a-3e0d2b9d7f10",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
        "status": {},
    }


def admission_review(
    pod: Mapping[str, Any],
    *,
    namespace: str = "inference",
    operation: str = "CREATE",
    dry_run: bool = False,
) -> dict[str, Any]:
    """An AdmissionReview v1 request for a pod, the way kube-apiserver sends it (name empty: generateName)."""
    gvk = {"group": "", "version": "v1", "kind": "Pod"}
    gvr = {"group": "", "version": "v1", "resource": "pods"}
    return {
        "apiVersion": API_VERSION,
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": "",
            "namespace": namespace,
            "operation": operation,
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "a5c7e3f1-1f5e-4f43-8a3c-0d8c2a8a1b22",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"],
            },
            "object": copy.deepcopy(dict(pod)),
            "oldObject": None,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def apply_response(pod: Mapping[str, Any], answer: Mapping[str, Any]) -> dict[str, Any]:
    """The pod after the API server applied the webhook's patch (a copy; `pod` is unchanged)."""
    response = answer["response"]
    if "patch" not in response:
        return copy.deepcopy(dict(pod))
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"], validate=True))
    return jsonpatch.apply_patch(dict(pod), ops)  # copies; raises on an op the object cannot take


def check_pod(pod: Mapping[str, Any]) -> None:
    """What the API server enforces on a created Pod beyond field names and types (a subset of ValidatePod)."""
    validate_strict(dict(pod))
    spec = pod["spec"]
    volumes = [v["name"] for v in spec.get("volumes") or []]
    assert len(volumes) == len(set(volumes)), f"duplicate volume names: {volumes}"
    for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
        mounts = c.get("volumeMounts") or []
        paths = [m["mountPath"] for m in mounts]
        assert len(paths) == len(set(paths)), f"container {c['name']}: duplicate mountPath: {paths}"
        for m in mounts:
            assert m["name"] in volumes, f"container {c['name']}: mount {m['name']} names no volume"
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required is not None:
        assert required.get("nodeSelectorTerms"), "required node affinity needs at least one nodeSelectorTerm"
    for term in ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "preferredDuringSchedulingIgnoredDuringExecution"
    ) or []:
        assert 1 <= term["weight"] <= 100


def envs(c: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env") or []}
