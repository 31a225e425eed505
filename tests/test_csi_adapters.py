"""A pod's LoRA adapter directory (weightcache/csi/adapters.py, docs/adapters.md) over real gRPC, real bind mounts
and the moto S3 server: adapters declared for the base model by ModelCaches with `spec.baseModel` appear in the
mounted read-only view while it is mounted, each only when the pod's namespace may have it; a linked adapter is
never evicted while the volume is published, unless the disk is below the floor; unpublish releases them all."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.fake_apiserver import FakeApiServer
from tests.faultproxy import FaultProxy
from tests.fixtures_csi import (
    ALLOWED_NS,
    MODEL_URI,
    OTHER_NS,
    ROOT_MARKS,
    CsiHarness,
    publish_request,
    start_harness,
    status_of,
    stop_harness,
    unmount_under,
)
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_kube import NODE
from tests.fixtures_s3 import S3
from weightcache.access import ADMIN, Authority
from weightcache.csi import adapters, mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.reconcile import VolumeBook
from weightcache.errors import InUseError
from weightcache.store import StreamViews
from weightcache.uri import parse_ref

pytestmark = ROOT_MARKS

ADAPTERS = {"adapters": "true"}


def make_adapter(path: Path, seed: int) -> None:
    """A PEFT LoRA adapter (rank 2) for the test's base: what `peft.save_pretrained` writes."""
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 64, generator=gen),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 2, generator=gen)},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "base_model_name_or_path": "x"}))


def adapter_cache(name: str, namespaces: list[str]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"source": f"s3://adapters/{name}/", "baseModel": MODEL_URI,
                                                 "allowedNamespaces": namespaces}}


@pytest.fixture
async def lora(safe_tmp: Path, model_in_s3: str, s3: S3, fault_proxy: FaultProxy) -> AsyncIterator[
        tuple[CsiHarness, list[dict[str, Any]]]]:
    for name, seed in (("sql", 1), ("chat", 2), ("code", 3)):
        make_adapter(safe_tmp / "adapters" / name, seed)
        s3.upload_dir(safe_tmp / "adapters" / name, "adapters", f"{name}/")
    caches = [{"metadata": {"name": "llama"}, "spec": {"source": MODEL_URI, "allowedNamespaces": [ALLOWED_NS]}},
              adapter_cache("sql", [ALLOWED_NS]), adapter_cache("chat", [OTHER_NS])]
    harness = await start_harness(safe_tmp, fault_proxy, authority=Authority(model_caches=lambda: caches,
                                                                             allow_undeclared=lambda: False))
    try:
        yield harness, caches
    finally:
        await stop_harness(harness)


async def cache(csi: CsiHarness, authority: Authority, name: str) -> str:
    snapshot = await csi.fetches.ensure(authority.authorize(parse_ref(f"s3://adapters/{name}/"), ADMIN))
    return snapshot.id


async def test_adapters_appear_in_a_mounted_directory_per_namespace_and_stay_while_it_is_published(
        lora: tuple[CsiHarness, list[dict[str, Any]]], safe_tmp: Path) -> None:
    csi, caches = lora
    authority = Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)
    sql, chat = await cache(csi, authority, "sql"), await cache(csi, authority, "chat")
    target = csi.target("vol-a")
    await csi.node.NodePublishVolume(csi.publish_request("vol-a", **ADAPTERS))
    entry = mounts.mounted_at(target)
    assert entry is not None and {"ro", "nosuid", "nodev"} <= entry.options
    assert sorted(p.name for p in target.iterdir()) == ["sql"], "chat is another namespace's adapter"
    src = safe_tmp / "adapters" / "sql"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (target / "sql" / name).read_bytes() == (src / name).read_bytes()
    with pytest.raises(OSError):
        (target / "sql" / "extra").write_text("no")  # read-only for the pod

    # declared and fetched while the pod runs: it appears in the same mount
    caches.append(adapter_cache("code", [ALLOWED_NS]))
    code = await cache(csi, authority, "code")
    book, views = VolumeBook(csi.store.tree), StreamViews(csi.store.layout)
    await adapters.fill_all(csi.store, book, views, authority, csi.fetches)
    assert sorted(p.name for p in target.iterdir()) == ["code", "sql"]
    assert json.loads((target / "code" / "adapter_config.json").read_text())["peft_type"] == "LORA"

    with pytest.raises(InUseError, match="adapter:vol-a/sql"):
        csi.store.evict(sql)
    csi.store.evict(chat)  # nobody's directory holds it: an adapter is evicted like any model

    # no longer allowed to the namespace: it leaves the directory, and its lease goes
    caches[1]["spec"]["allowedNamespaces"] = [OTHER_NS]
    await adapters.fill_all(csi.store, book, views, authority, csi.fetches)
    assert sorted(p.name for p in target.iterdir()) == ["code"]
    csi.store.evict(sql)

    # below the free-space floor: the directories hold nothing, and the floor is restored by eviction
    limits = csi.store.limits
    csi.store.set_limits(budget_bytes=None, min_free_bytes=limits.min_free_bytes or 0, min_free_percent=100.0,
                         set_by="test")
    await adapters.fill_all(csi.store, book, views, authority, csi.fetches)
    assert list(target.iterdir()) == []
    assert code not in {i.snapshot.id for i in csi.store.list()}, "evicted to give the floor back"

    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-a"))
    assert mounts.mounted_at(target) is None
    assert not [h for h in csi.store.leases() if h.startswith("adapter:")]


async def test_a_namespace_not_allowed_the_base_model_gets_no_adapter_directory(
        lora: tuple[CsiHarness, list[dict[str, Any]]]) -> None:
    csi, _ = lora
    code, message = await status_of(csi.node.NodePublishVolume(csi.publish_request("vol-b", namespace=OTHER_NS,
                                                                                   **ADAPTERS)))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "team-b" in message
    code, message = await status_of(csi.node.NodePublishVolume(csi.publish_request("vol-c", stream="true",
                                                                                   **ADAPTERS)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "use two volumes" in message


async def test_a_daemon_fetches_the_adapters_of_a_published_directory_for_its_namespace(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    """In cluster mode, nothing prefetches the adapter (no nodeSelector): the node fetches it because a pod of a
    namespace it is allowed to has an adapter directory for its base, and links it in while the pod runs."""
    base = f"file://{model_copy}/"
    make_adapter(short_dir / "lora" / "sql", 1)
    cluster.create("modelcaches", {"metadata": {"name": "llama"}, "spec": {"source": base,
                                                                          "allowedNamespaces": [ALLOWED_NS]}})
    cluster.create("modelcaches", {"metadata": {"name": "sql"}, "spec": {
        "source": f"file://{short_dir}/lora/sql/", "baseModel": base, "allowedNamespaces": [ALLOWED_NS]}})
    csi_sock, kubelet = short_dir / "csi.sock", short_dir / "kubelet"
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE},
                           config={"csiEndpoint": f"unix://{csi_sock}", "kubeletDir": str(kubelet)})
    target = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / "adapters" / "mount"
    try:
        # before its first list the node cannot decide (UNAVAILABLE, kubelet retries: test_csi_stream.py)
        await eventually(lambda: d.daemon.node.ready().get("modelcaches_synced"), what="the ModelCache watch")
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            stub = csi_pb2_grpc.NodeStub(channel)
            await stub.NodePublishVolume(publish_request("vol-1", target, model=base, namespace=ALLOWED_NS,
                                                         pod_uid="uid-1", **ADAPTERS))
            await eventually(lambda: (target / "sql" / "adapter_config.json").is_file(), timeout=20,
                             what="the node to fetch the adapter and link it into the mounted directory")
            models = cluster.get("modelcachenodes", NODE)["status"]["models"]
            assert models["sql"]["phase"] == "Ready"
            await stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="vol-1",
                                                                              target_path=str(target)))
        d.daemon.node.kick()
        store = d.daemon.node.store
        await eventually(lambda: not [i for i in store.list() if i.pinned or i.leases],
                         what="the adapter to be neither pinned nor leased once no directory wants it")
    finally:
        await d.daemon.stop()
        unmount_under(short_dir)
