"""A grant's include/exclude globs hold at NodePublishVolume: a namespace granted `*.safetensors` of a prefix
neither mounts nor makes the node download the rest (real gRPC, real S3 server, real bind mounts)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from tests import fixtures_csi
from tests.faultproxy import FaultProxy
from tests.fixtures_csi import ALLOWED_NS, MODEL_URI, needs_root
from weightcache.access import Authority

GRANT = [{"metadata": {"name": "llama-weights"},
          "spec": {"source": MODEL_URI, "include": ["*.safetensors", "*.json"], "exclude": ["tokenizer*"],
                   "allowedNamespaces": [ALLOWED_NS]}}]


@needs_root
async def test_a_glob_grant_mounts_and_fetches_only_the_granted_files(
        safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> None:
    authority = Authority(model_caches=lambda: GRANT)
    h = await fixtures_csi.start_harness(safe_tmp, fault_proxy, authority=authority)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.node.NodePublishVolume(h.publish_request("vol-all"))
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = caught.value.details() or ""
        assert "ModelCache llama-weights grants namespace 'ml' only" in details
        assert "include: '*.safetensors,*.json', exclude: 'tokenizer*'" in details
        assert not h.proxy.requests_for("GET"), "a refused request must not start a download"

        await h.node.NodePublishVolume(h.publish_request(
            "vol-weights", include='["*.safetensors", "*.json"]', exclude="tokenizer*,*.index.json"))
        mounted = sorted(os.listdir(h.target("vol-weights")))
        assert mounted == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        fetched = {r.path.rsplit("/", 1)[-1] for r in h.proxy.requests_for("GET") if "list-type" not in r.path}
        assert "tokenizer.json" not in fetched and "model.safetensors.index.json" not in fetched
        await h.node.NodeUnpublishVolume(h.unpublish_request("vol-weights"))
    finally:
        await fixtures_csi.stop_harness(h)


@pytest.mark.parametrize(("attribute", "value"), [("include", '["*.bin", 3]'), ("exclude", "/etc/*")])
async def test_bad_glob_attributes_are_invalid_argument_naming_the_attribute(
        safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy, attribute: str, value: str) -> None:
    h = await fixtures_csi.start_harness(safe_tmp, fault_proxy)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            request = (h.publish_request("vol-bad", include=value) if attribute == "include"
                       else h.publish_request("vol-bad", exclude=value))
            await h.node.NodePublishVolume(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"volume_context.{attribute}" in (caught.value.details() or "")
        assert "*.safetensors" in (caught.value.details() or "")  # says what to write instead
    finally:
        await fixtures_csi.stop_harness(h)
