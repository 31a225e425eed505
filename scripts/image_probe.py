"""The host side of the image tier (scripts/test_image.sh): what a node and the API server do to the containers.

    s3 READY_FILE               a real S3 server (moto) on 127.0.0.1 holding a small model under s3://models/tiny/;
                                writes its endpoint URL to READY_FILE, serves until SIGTERM
    csi SOCKET TARGET MODEL     CSI Identity and Node over the plugin socket as kubelet calls them, then a publish of
                                MODEL on TARGET (kubelet's inline-volume request); prints what answered
    unpublish SOCKET TARGET     NodeUnpublishVolume of that volume
    readonly TARGET             exit 1 unless THIS mount namespace (the host's) sees TARGET ro,nosuid,nodev
    admission PORT CA           an AdmissionReview over TLS to the webhook (verified against CA for its Service name);
                                exit 1 unless the pod is allowed and patched with the model's volume

Run from the repository root with PYTHONPATH=. (it reuses the test suite's builders of real requests and models).
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import ssl
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

VOLUME_ID = "image-tier-vol"
SERVICE_HOST = "weightcache-webhook.weightcache.svc"  # the name `weightcache webhook certs` signs


def serve_s3(ready_file: str) -> int:
    from moto.server import ThreadedMotoServer

    from tests.sample import make_model

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket="models")
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, layers=2, hidden=64, vocab=128)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                client.upload_file(str(path), "models", f"tiny/{path.relative_to(tmp)}")
    Path(ready_file).write_text(endpoint)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


async def _csi(socket_path: str, target: str, model: str) -> int:
    import grpc

    from tests.fixtures_csi import publish_request
    from weightcache.csi._pb import csi_pb2, csi_pb2_grpc

    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        identity, node = csi_pb2_grpc.IdentityStub(channel), csi_pb2_grpc.NodeStub(channel)
        info = await identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10)
        probe = await identity.Probe(csi_pb2.ProbeRequest(), timeout=10)
        node_info = await node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
        caps = await node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
        print(f"CSI Identity: {info.name} {info.vendor_version}, ready={probe.ready.value}; "
              f"Node: {node_info.node_id}, {len(caps.capabilities)} capabilities")
        if not probe.ready.value:
            return 1
        request = publish_request(VOLUME_ID, Path(target), model=model, pod_uid=VOLUME_ID)
        await node.NodePublishVolume(request, timeout=120)
        print(f"CSI NodePublishVolume {model} on {target}: OK")
    return 0


async def _unpublish(socket_path: str, target: str) -> int:
    import grpc

    from weightcache.csi._pb import csi_pb2, csi_pb2_grpc

    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        request = csi_pb2.NodeUnpublishVolumeRequest(volume_id=VOLUME_ID, target_path=target)
        await csi_pb2_grpc.NodeStub(channel).NodeUnpublishVolume(request, timeout=30)
    print(f"CSI NodeUnpublishVolume {target}: OK")
    return 0


def readonly(target: str) -> int:
    from weightcache.csi import mounts

    entry = mounts.mounted_at(target)
    seen = sorted(entry.options) if entry else "no mount"
    print(f"the host's mountinfo at {target}: {seen}")
    return 0 if entry is not None and entry.options >= mounts.READ_ONLY_OPTIONS else 1


def admission(port: str, ca: str) -> int:
    from tests.fixtures_webhook import admission_review, deployment_pod

    body = json.dumps(admission_review(deployment_pod({"weightcache.io/model": "s3://models/tiny/"}))).encode()
    context = ssl.create_default_context(cafile=ca)
    request = urllib.request.Request(f"https://{SERVICE_HOST}:{port}/mutate", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    # the Service name resolves to 127.0.0.1 here: connect there, verify the certificate for the Service's name
    opener = urllib.request.build_opener(_PinnedHTTPS(context))
    with opener.open(request, timeout=10) as answer:
        response = json.load(answer)["response"]
    patch = json.loads(base64.b64decode(response.get("patch", "") or b"W10="))
    volumes = [op for op in patch if "volumes" in op.get("path", "")]
    print(f"AdmissionReview over TLS: allowed={response['allowed']}, {len(patch)} patch operations, "
          f"{len(volumes)} on volumes")
    return 0 if response["allowed"] and volumes else 1


class _PinnedHTTPS(urllib.request.HTTPSHandler):
    """HTTPS to 127.0.0.1 whatever the URL's host, with SNI and verification for the URL's host."""

    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(context=context)
        self._context = context

    def https_open(self, req: urllib.request.Request) -> object:
        import http.client

        context = self._context

        class Connection(http.client.HTTPSConnection):
            def connect(self) -> None:
                import socket

                sock = socket.create_connection(("127.0.0.1", self.port or 443), self.timeout)
                self.sock = context.wrap_socket(sock, server_hostname=self.host)

        return self.do_open(Connection, req)


def main(argv: list[str]) -> int:
    match argv:
        case ["s3", ready_file]:
            return serve_s3(ready_file)
        case ["csi", socket_path, target, model]:
            return asyncio.run(_csi(socket_path, target, model))
        case ["unpublish", socket_path, target]:
            return asyncio.run(_unpublish(socket_path, target))
        case ["readonly", target]:
            return readonly(target)
        case ["admission", port, ca]:
            return admission(port, ca)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
