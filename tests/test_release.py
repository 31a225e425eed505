"""The release: one version (pyproject.toml) everywhere it is shown, `weightcache version`, the build_info gauge, the
CHANGELOG's shape, and the release workflow against the official GitHub workflow schema (check-jsonschema's vendored
copy) plus the steps a release must not lose."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from tests.command import weightcache
from weightcache.daemon.metrics import Metrics
from weightcache.store.index import SCHEMA_VERSION
from weightcache.store.records import MANIFEST_VERSION

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")


def test_the_version_is_semver_and_the_installed_one() -> None:
    from importlib.metadata import version

    import weightcache as package

    assert SEMVER.match(VERSION), VERSION
    assert version("weightcache") == package.__version__ == VERSION, (
        "the installed metadata is stale: reinstall (pip install -e .) or remove a stale weightcache.egg-info")


def test_version_command_json() -> None:
    done = weightcache("version", "-o", "json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["version"] == VERSION
    assert info["python"] == platform.python_version()
    assert info["platform"] == platform.platform()
    assert info["store_format"] == {"manifest": MANIFEST_VERSION, "index_schema": SCHEMA_VERSION}


def test_version_command_text() -> None:
    done = weightcache("version")
    assert done.returncode == 0, done.stderr
    first, *rest = done.stdout.splitlines()
    assert first == f"weightcache {VERSION}"
    assert any(platform.python_version() in line for line in rest)
    assert weightcache("--version").stdout.strip() == f"weightcache {VERSION}"


def test_build_info_gauge_names_the_version() -> None:
    text = Metrics().exposition().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("weightcache_build_info{")]
    assert f'version="{VERSION}"' in line and line.endswith(" 1.0")


def test_every_place_that_shows_the_version_agrees() -> None:
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "weightcache" / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == chart["appVersion"] == VERSION
    kust = yaml.safe_load((ROOT / "deploy" / "daemonset" / "kustomization.yaml").read_text())
    (image,) = [i for i in kust["images"] if i["name"] == "ghcr.io/weightcache/weightcache"]
    assert image["newTag"] == VERSION
    # manifests applied alone (the uninstall DaemonSet) name the image themselves: the same version
    tags = {m for f in (ROOT / "deploy").rglob("*.yaml") if "helm" not in f.parts
            for m in re.findall(r"ghcr\.io/weightcache/weightcache:([^\s\"']+)", f.read_text())}
    assert tags == {VERSION}
    (top,) = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)[:1]
    assert top == VERSION
    assert f"## {'.'.join(VERSION.split('.')[:2])}" in (ROOT / "docs" / "upgrade.md").read_text() or \
        f"to {VERSION}" in (ROOT / "docs" / "upgrade.md").read_text()


def test_changelog_keeps_a_changelog() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## \[([^\]]+)\] - (\S+)", text, re.M)
    assert [v for v, _ in sections][-1] == "0.1.0" and len({v for v, _ in sections}) == len(sections)
    for v, date in sections:
        assert SEMVER.match(v) and (date == "Unreleased" or re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)), (v, date)
        assert f"[{v}]: https://" in text  # the link reference each heading uses
    allowed = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    assert set(re.findall(r"^### (\w+)", text, re.M)) <= allowed
    current = text.split(f"## [{VERSION}]", 1)[1].split("\n## [", 1)[0]
    for topic in ("authorization", "Hardening", "layers", "header check", "record book", "claim admission"):
        assert topic.lower() in current.lower(), topic


def workflow() -> dict[Any, Any]:
    doc: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return doc


def test_release_workflow_matches_githubs_schema() -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(checker), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def steps(job: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = workflow()["jobs"][job]["steps"]
    return found


def uses(job: str, action: str) -> dict[str, Any]:
    (step,) = [s for s in steps(job) if s.get("uses", "").split("@")[0] == action]
    return step


def test_release_workflow_builds_signs_and_publishes_what_a_release_needs() -> None:
    wf = workflow()
    assert wf[True] == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads the key `on` as True
    build = uses("image", "docker/build-push-action")["with"]
    assert build["platforms"] == "linux/amd64,linux/arm64" and build["push"] is True and build["sbom"] is True
    assert build["file"] == "Dockerfile" and "ghcr.io/" in wf["jobs"]["image"]["env"]["IMAGE"]
    assert "requirements.lock" in (ROOT / "Dockerfile").read_text()  # the image builds from the lock
    assert wf["jobs"]["image"]["permissions"]["id-token"] == "write"  # keyless signing
    sign = " ".join(s.get("run", "") for s in steps("image"))
    assert "cosign sign --yes" in sign and "@${DIGEST}" in sign  # the digest, never a movable tag
    dists = " ".join(s.get("run", "") for s in steps("dists"))
    assert "python -m build --outdir dist ." in dists and "packages/weightcache-loader" in dists
    assert "packages/weightcache-vllm" in dists and "--find-links dist weightcache-vllm" in dists
    # reproducible: the base by digest, timestamps clamped (scripts/test_image.sh checks two builds agree)
    assert re.fullmatch(r"python:[0-9.]+-slim-bookworm@sha256:[0-9a-f]{64}", wf["jobs"]["image"]["env"]["PYTHON_IMAGE"])
    assert build["build-args"] == "PYTHON_IMAGE=${{ env.PYTHON_IMAGE }}"
    assert "rewrite-timestamp=true" in build["outputs"]
    assert "SOURCE_DATE_EPOCH" in " ".join(s.get("run", "") for s in steps("image"))
    assert "helm package deploy/helm/weightcache" in dists
    notes = " ".join(s.get("run", "") for s in steps("github-release"))
    assert "CHANGELOG.md" in notes and "gh release create" in notes
    check = " ".join(s.get("run", "") for s in steps("check"))
    assert "pyproject.toml" in check and "GITHUB_REF_NAME" in check
    for job in wf["jobs"].values():  # every third-party action pinned to a release
        for step in job["steps"]:
            if "uses" in step:
                assert "@" in step["uses"], step["uses"]


def test_the_changelog_section_the_workflow_extracts_is_this_versions(tmp_path: Path) -> None:
    (run,) = [s["run"] for s in steps("github-release") if "awk" in s.get("run", "")]
    (tmp_path / "CHANGELOG.md").write_bytes((ROOT / "CHANGELOG.md").read_bytes())
    done = subprocess.run(["bash", "-c", run], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                          env={"VERSION": VERSION, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    notes = (tmp_path / "notes.md").read_text()
    assert notes.strip() and "### Added" in notes and "## [" not in notes


def test_the_workflow_refuses_a_tag_that_is_not_the_version(tmp_path: Path) -> None:
    (run,) = [s["run"] for s in steps("check") if "GITHUB_REF_NAME" in s.get("run", "")]

    def check(tag: str) -> subprocess.CompletedProcess[str]:
        out = tmp_path / f"{tag}.out"
        return subprocess.run(["bash", "-e", "-c", run], capture_output=True, text=True, timeout=30, cwd=ROOT,
                              env={"GITHUB_REF_NAME": tag, "GITHUB_OUTPUT": str(out),
                                   "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})  # `python` as setup-python

    ok = check(f"v{VERSION}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (tmp_path / f"v{VERSION}.out").read_text() == f"version={VERSION}\n"
    bad = check("v9.9.9")
    assert bad.returncode != 0 and "is not the package version" in bad.stdout
