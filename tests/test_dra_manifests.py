"""deploy/dra as kustomize renders it: every built-in object strict-valid for Kubernetes 1.34, the DeviceClass's
CEL selector (cel-python) takes this driver's devices and nothing else, the daemon really starts the DRA plugin
from the DaemonSet's args, it sees the host's CDI directory, and RBAC grants what the plugin calls."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from tests.fixtures_crd_cel import cel_eval
from tests.fixtures_dra import cel_device
from tests.fixtures_k8s_schema import has_schema, validate_strict
from tests.tools import kubectl
from weightcache.cli import build_parser
from weightcache.daemon.command import flags_of
from weightcache.daemon.config import load_settings
from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import devices_for
from weightcache.store import Snapshot

ROOT = Path(__file__).resolve().parent.parent



@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / "dra")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_every_object_is_valid_for_1_34(objects: list[dict[str, Any]]) -> None:
    checked = [o for o in objects if has_schema(o, "1.34")]
    for obj in checked:
        validate_strict(obj, "1.34")
    assert {"DeviceClass", "DaemonSet", "ClusterRole"} <= {o["kind"] for o in checked}


def test_device_class_selects_this_drivers_devices(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    cls = one(objects, "DeviceClass", DRIVER_NAME)
    [expression] = [s["cel"]["expression"] for s in cls["spec"]["selectors"]]
    [device] = devices_for([Snapshot("a" * 40, tmp_path, "s3://models/llama/", None, 1)], slots=1, shared=False)
    assert cel_eval(expression, {"device": cel_device(device)}) == celpy.celtypes.BoolType(True)
    gpu = celpy.json_to_cel({"driver": "gpu.example.com", "attributes": {"gpu.example.com": {"ready": True}},
                             "capacity": {}})
    assert cel_eval(expression, {"device": gpu}) == celpy.celtypes.BoolType(False)


def test_the_daemonset_starts_the_plugin_and_sees_the_cdi_dir(objects: list[dict[str, Any]]) -> None:
    ds = one(objects, "DaemonSet", "weightcache-node")
    pod = ds["spec"]["template"]["spec"]
    [daemon] = [c for c in pod["containers"] if c["name"] == "weightcache"]
    parser = build_parser()  # `daemon` declares its flags, the settings' own, when it parses
    args = parser.parse_args(daemon["args"])
    settings = load_settings(None, env={}, flags=flags_of(args))  # the config file is applied on the node
    assert settings.dra is not None
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[str(settings.dra.cdi_dir)]]["hostPath"]["path"] == str(settings.dra.cdi_dir)
    kubelet = volumes[mounts[str(settings.csi.kubelet_dir)]]["hostPath"]["path"]
    assert kubelet == str(settings.csi.kubelet_dir)  # the plugin's sockets are where kubelet looks


def test_rbac_grants_what_the_plugin_calls(objects: list[dict[str, Any]]) -> None:
    role = one(objects, "ClusterRole", "weightcache-dra")
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
              for r in rule["resources"]}
    # SlicePublisher: list (fieldSelector), create, replace (PUT = update), delete; claim_reader: get;
    # ClaimBinder (1.36+): list and watch claims, read one, merge-patch its status
    assert {"list", "create", "update", "delete"} <= grants[("resource.k8s.io", "resourceslices")]
    assert grants[("resource.k8s.io", "resourceclaims")] == {"get", "list", "watch"}
    assert grants[("resource.k8s.io", "resourceclaims/status")] == {"patch", "update"}
    binding = one(objects, "ClusterRoleBinding", "weightcache-dra")
    ds = one(objects, "DaemonSet", "weightcache-node")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ds["spec"]["template"]["spec"][
        "serviceAccountName"], "namespace": ds["metadata"]["namespace"]}]
