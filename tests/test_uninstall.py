"""`weightcache uninstall-node` on a real temp node: a real store with a fetched model, real CDI specs written by
the DRA driver's own code (and another driver's, which stays), the plugin sockets, a live daemon socket, and the
node's readiness labels on the fake API server; and deploy/components/uninstall, strictly valid, running it."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest
import yaml

from tests.command import run_cli
from tests.fake_apiserver import FakeApiServer
from tests.fixtures_k8s_schema import load_docs, validate_file
from tests.fixtures_kube import NODE
from tests.fixtures_store import fetch, make_models
from weightcache import cli, defaults
from weightcache.dra.cdi import ModelMount, write_spec
from weightcache.store import Store
from weightcache.store.holders import csi_holder
from weightcache.uri import readiness_label
from weightcache.vocabulary import CSI_DRIVER, DRA_DRIVER

ROOT = Path(__file__).resolve().parent.parent


class Node:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.root, self.kubelet, self.cdi, self.run = base / "store", base / "kubelet", base / "cdi", base / "run"
        models = make_models(base / "src", "llama")
        self.store = Store(self.root)
        self.snapshot = fetch(self.store, models["llama"])
        self.uri = f"file://{models['llama']}/"
        for driver in (CSI_DRIVER, DRA_DRIVER):
            (self.kubelet / "plugins" / driver).mkdir(parents=True)
            (self.kubelet / "plugins_registry").mkdir(exist_ok=True)
            (self.kubelet / "plugins_registry" / f"{driver}-reg.sock").write_bytes(b"")
        (self.kubelet / "plugins" / CSI_DRIVER / "csi.sock").write_bytes(b"")  # left by a stopped plugin
        (self.kubelet / "plugins" / DRA_DRIVER / "dra.sock").write_bytes(b"")
        (self.kubelet / "plugins" / "other.example.com").mkdir()
        self.spec = write_spec(self.cdi, "0f1e2d3c-uid", [ModelMount("model-0", str(self.snapshot.path), "/models/m")])
        (self.cdi / "nvidia.com-gpu.json").write_text("{}")
        self.run.mkdir()
        (self.run / "weightcache.sock").write_bytes(b"")

    def argv(self, *extra: str) -> list[str]:
        return ["uninstall-node", "--root", str(self.root), "--kubelet-dir", str(self.kubelet),
                "--cdi-dir", str(self.cdi), "--run-dir", str(self.run), *extra]


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    base = Path(os.path.realpath(tmp_path))
    return Node(base)


@pytest.fixture
def cluster(apiserver: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    """No nodes: each test creates this node (NODE_NAME) with the labels it needs."""
    apiserver.use_as_kubeconfig(tmp_path, monkeypatch)
    monkeypatch.setenv("NODE_NAME", NODE)
    return apiserver


def test_without_yes_it_only_says_what_it_would_remove(node: Node, capsys) -> None:
    code, out, _ = run_cli(capsys, *node.argv("-o", "json"))
    assert code == 0
    report = json.loads(out)
    assert report["applied"] is False and "nothing removed: run again with --yes" in report["notes"]
    paths = {i["path"] for i in report["wouldRemove"]}
    assert paths == {str(node.root), str(node.spec), str(node.run),
                     *(str(node.kubelet / "plugins" / d) for d in (CSI_DRIVER, DRA_DRIVER)),
                     *(str(node.kubelet / "plugins_registry" / f"{d}-reg.sock") for d in (CSI_DRIVER, DRA_DRIVER))}
    assert node.snapshot.path.is_dir() and node.spec.is_file()  # untouched


def test_yes_removes_this_drivers_files_and_nothing_else(node: Node, capsys) -> None:
    snapshot_dir = node.snapshot.path
    assert not os.stat(snapshot_dir).st_mode & stat.S_IWUSR  # snapshot trees are read-only
    code, out, _ = run_cli(capsys, *node.argv("--yes"))
    assert code == 0, out
    assert f"removed {node.root}: the model store" in out and f"removed {node.spec}" in out
    assert not node.root.exists() and not node.spec.exists() and not node.run.exists()
    assert not (node.kubelet / "plugins" / CSI_DRIVER).exists()
    assert not (node.kubelet / "plugins" / DRA_DRIVER).exists()
    assert sorted(p.name for p in (node.kubelet / "plugins_registry").iterdir()) == []
    # another driver's CDI spec and plugin directory stay, and the model's source is untouched
    assert (node.cdi / "nvidia.com-gpu.json").read_text() == "{}"
    assert (node.kubelet / "plugins" / "other.example.com").is_dir()
    assert (node.base / "src" / "llama").is_dir()
    code, out, _ = run_cli(capsys, *node.argv("--yes"))  # again: nothing left
    assert code == 0 and "nothing of weightcache found on this node" in out


def test_a_held_lease_refuses_naming_the_holder(node: Node, capsys) -> None:
    node.store.lease(csi_holder("csi-4f1d2a"), node.snapshot.id)
    code, _, err = run_cli(capsys, *node.argv("--yes"))
    assert code == 4  # in use
    assert "csi-4f1d2a" in err and "--force" in err
    assert node.snapshot.path.is_dir() and node.spec.is_file()  # nothing removed
    code, out, _ = run_cli(capsys, *node.argv("--yes", "--force", "-o", "json"))
    assert code == 0 and not node.root.exists()
    assert any("csi-4f1d2a" in n for n in json.loads(out)["notes"])


def test_a_running_daemon_refuses(node: Node, capsys) -> None:
    (node.run / "weightcache.sock").unlink()
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(node.run / "weightcache.sock"))
        listening.listen(1)
        code, _, err = run_cli(capsys, *node.argv("--yes"))
        assert code == 4 and "weightcache-node DaemonSet" in err
        assert node.root.exists()
    code, _, _ = run_cli(capsys, *node.argv("--yes"))  # the socket no longer answers: a stopped daemon
    assert code == 0 and not node.root.exists()


def test_a_directory_that_is_not_a_store_is_never_removed(node: Node, tmp_path: Path, capsys) -> None:
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("x")
    argv = node.argv("--yes")
    argv[argv.index("--root") + 1] = str(precious)
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "does not look like a weightcache store" in err
    assert (precious / "thesis.tex").read_text() == "x" and node.spec.exists()


def test_readiness_labels_of_this_node_are_removed(node: Node, cluster: FakeApiServer, capsys) -> None:
    ready = readiness_label(node.uri)
    labels = {ready: "ready", "weightcache.io/memory-pool": "a", "kubernetes.io/hostname": NODE}
    cluster.create("nodes", {"metadata": {"name": NODE, "labels": labels}})
    cluster.create("nodes", {"metadata": {"name": "gpu-2", "labels": {ready: "ready"}}})
    code, out, _ = run_cli(capsys, *node.argv("-o", "json"))
    assert code == 0 and json.loads(out)["wouldRemoveLabels"] == [ready]
    assert ready in cluster.get("nodes", NODE)["metadata"]["labels"]  # a dry run
    code, out, _ = run_cli(capsys, *node.argv("--yes", "-o", "json"))
    assert code == 0 and json.loads(out)["labels"] == [ready] and json.loads(out)["node"] == NODE
    assert cluster.get("nodes", NODE)["metadata"]["labels"] == {"weightcache.io/memory-pool": "a",
                                                                 "kubernetes.io/hostname": NODE}
    assert ready in cluster.get("nodes", "gpu-2")["metadata"]["labels"]  # another node's are its own


def test_the_uninstall_daemonset_runs_the_command_on_the_node_paths(capsys) -> None:
    path = ROOT / "deploy" / "components" / "uninstall" / "daemonset.yaml"
    [ds] = load_docs(path)
    for version in ("1.30", "1.34"):
        assert validate_file(path, version=version) == []  # every document has a schema and is strictly valid
    spec = ds["spec"]["template"]["spec"]
    [init] = spec["initContainers"]
    args = cli.build_parser().parse_args(init["args"])
    assert args.func is cli.cmd_uninstall_node and args.yes and not args.force
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    by_mount = {m["mountPath"]: hosts[m["name"]] for m in init["volumeMounts"]}
    assert by_mount == {p: p for p in mounts}  # the same paths inside and on the host
    assert {args.root, args.cdi_dir, args.run_dir} <= mounts
    assert {f"{args.kubelet_dir}/plugins", f"{args.kubelet_dir}/plugins_registry"} <= mounts
    assert args.root == str(defaults.ROOT) and args.kubelet_dir == str(defaults.KUBELET_DIR)
    assert args.cdi_dir == str(defaults.CDI_DIR) and args.run_dir == str(defaults.SOCKET.parent)
    node_ds = yaml.safe_load((ROOT / "deploy" / "daemonset" / "daemonset.yaml").read_text())["spec"]["template"]
    node_hosts = {v["hostPath"]["path"] for v in node_ds["spec"]["volumes"] if "hostPath" in v}
    assert {defaults.ROOT.as_posix(), "/run/weightcache", "/var/lib/kubelet/plugins_registry"} <= node_hosts
    assert spec["serviceAccountName"] == node_ds["spec"]["serviceAccountName"]  # the node policy lets it unlabel
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in init["env"]
