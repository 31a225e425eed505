"""docs/operations.md holds true: its kustomizations and `kubectl ... -k` paths render with the real kustomize and
validate, the paths and CLI commands it names exist, and the image it describes installs only hashed, locked
wheels (the image itself is built and run by the image tier, scripts/test_image.sh)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.command import weightcache
from tests.test_manifests_kustomize import assert_valid, kustomize, one, strings

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operations.md"
TEXT = DOC.read_text()



def rendered_examples() -> list[str]:
    blocks = []
    for marker in re.finditer(r"<!-- rendered: tests/test_operations_docs.py -->\n```yaml\n(.*?)```", TEXT, re.S):
        blocks.append(marker.group(1))
    return blocks


def in_user_tree(tmp_path: Path, text: str) -> Path:
    """The doc's layout: my-cluster/weightcache/kustomization.yaml beside a `weightcache` checkout."""
    (tmp_path / "weightcache").symlink_to(ROOT)
    overlay = tmp_path / "my-cluster" / "weightcache"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(text)
    return overlay


def test_the_doc_has_its_examples() -> None:
    assert len(rendered_examples()) == 2


def test_the_overlay_example_renders(tmp_path: Path) -> None:
    objs = kustomize(in_user_tree(tmp_path, rendered_examples()[0]))
    assert_valid(objs)
    images = {c["image"] for o in objs if o["kind"] in ("DaemonSet", "Deployment")
              for c in o["spec"]["template"]["spec"]["containers"]}
    assert "registry.example.com/ml/weightcache:0.1.0" in images
    assert one(objs, "PodMonitor", "weightcache-node")
    assert "affinity" in one(objs, "DaemonSet")["spec"]["template"]["spec"]


def test_the_other_namespace_example_renders_with_every_reference_moved(tmp_path: Path) -> None:
    overlay = in_user_tree(tmp_path, rendered_examples()[1])
    block = yaml.safe_load((ROOT / "deploy" / "namespace" / "kustomization.yaml").read_text())["replacements"]
    (overlay / "replacements.yaml").write_text(yaml.safe_dump(block))
    objs = kustomize(overlay)
    assert_valid(objs)
    assert one(objs, "Namespace")["metadata"]["name"] == "ml-infra"
    assert not [s for s in strings(objs) if ".weightcache.svc" in s or ":weightcache:" in s
                or s.startswith("weightcache/")]
    assert one(objs, "ClusterRoleBinding", "weightcache-daemon-events")["subjects"][0]["namespace"] == "ml-infra"
    events_policy = one(objs, "ValidatingAdmissionPolicy", "weightcache-daemon-events")
    assert ":ml-infra:" in events_policy["spec"]["matchConditions"][0]["expression"]


@pytest.mark.parametrize("path", sorted(set(re.findall(r"kubectl (?:apply|delete) -k (deploy/[\w/-]+)", TEXT))))
def test_every_kubectl_k_path_in_the_doc_renders(path: str) -> None:
    assert_valid(kustomize(ROOT / path))


def test_every_deploy_path_the_doc_names_exists() -> None:
    for path in set(re.findall(r"`(deploy/[\w./-]+)`", TEXT)):
        assert (ROOT / path).exists(), path


@pytest.mark.e2e
def test_every_weightcache_command_in_the_doc_exists() -> None:
    commands = set(re.findall(r"-- weightcache (\w+)", TEXT)) | set(re.findall(r"weightcache (webhook certs)", TEXT))
    assert {"ls", "verify", "webhook certs"} <= commands
    for command in commands:
        done = weightcache(*command.split(), "--help")
        assert done.returncode == 0, (command, done.stderr[-500:])


def test_the_image_installs_only_locked_hashed_wheels() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes" in dockerfile and "--only-binary :all:" in dockerfile and "apt-get" not in dockerfile
    assert "torch" not in (ROOT / "requirements.lock").read_text()  # the daemon's image has no torch
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base)  # a precise release
    assert base.split("@")[0] in TEXT  # the doc's digest commands name the same image
    requirements = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)",
                              (ROOT / "requirements.lock").read_text(), re.M)
    names = {name.lower().replace("_", "-") for name, _, _ in requirements}
    assert {"boto3", "aiohttp", "grpcio", "kubernetes", "huggingface-hub"} <= names
    for name in ("requirements.lock", "requirements-build.lock"):
        lock = (ROOT / name).read_text()
        pinned = re.findall(r"^[A-Za-z0-9_.-]+==", lock, re.M)
        hashed = re.findall(r"^[A-Za-z0-9_.-]+==\S+ \\\n\s+--hash=sha256:[0-9a-f]{64}", lock, re.M)
        assert pinned and len(pinned) == len(hashed), name  # every pin carries hashes
        assert f"-r /src/{name}" in dockerfile
