"""The stand-in API server (tests/fake_apiserver.py) as fixtures, started in one place.

    def test_x(apiserver: FakeApiServer): ...   # a fresh server with the project's CRD schemas; seed it in the test
    def test_y(cluster: FakeApiServer): ...     # the same server with one GPU node, NODE, as the kubeconfig that every
                                                # client of this process (and any daemon the test starts) finds

A module that needs other seed data overrides the fixture by name and asks for the shared one:

    @pytest.fixture
    def apiserver(apiserver: FakeApiServer) -> FakeApiServer:
        apiserver.create("nodes", node("n1"))
        return apiserver
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_apiserver import FakeApiServer, crd_schemas

NODE = "gpu-1"  # the node of `cluster`: labelled pool=a100, one allocatable GPU


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    with FakeApiServer(schemas=crd_schemas()) as server:
        yield server


@pytest.fixture
def cluster(apiserver: FakeApiServer, short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    # short_dir: a daemon started by the test keeps its socket there too (Unix socket paths are limited to 107 bytes)
    apiserver.create("nodes", {"metadata": {"name": NODE, "labels": {"pool": "a100"}},
                               "status": {"allocatable": {"nvidia.com/gpu": "1"}}})
    apiserver.use_as_kubeconfig(short_dir, monkeypatch)
    monkeypatch.setenv("POD_NAMESPACE", "weightcache")  # the webhook's own pod (its placement lease names it)
    monkeypatch.setenv("POD_NAME", "webhook-0")
    return apiserver
