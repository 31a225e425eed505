"""The stand-in API server (tests/fake_apiserver.py) as fixtures, started in one place.

    def test_x(apiserver: FakeApiServer): ...   # a fresh server with the project's CRD schemas; seed it in the test
    @pytest.mark.shipped_access                 # ... that also enforces deploy/'s RBAC and admission policies
    def test_z(apiserver: FakeApiServer): ...   # (tests/fake_rules.py) for the tokens it hands out (token_for)
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
from tests.fake_rules import shipped_policies, shipped_rbac

NODE = "gpu-1"  # the node of `cluster`: labelled pool=a100, one allocatable GPU


@pytest.fixture
def apiserver(request: pytest.FixtureRequest) -> Iterator[FakeApiServer]:
    shipped = request.node.get_closest_marker("shipped_access") is not None
    with FakeApiServer(schemas=crd_schemas(), rbac=shipped_rbac() if shipped else None,
                       policies=shipped_policies() if shipped else None) as server:
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
