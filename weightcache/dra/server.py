"""Start the DRA kubelet plugin: the DRA gRPC service, the registration socket kubelet watches, and the
ResourceSlice publisher.

Sockets (kubelet's layout for DRA drivers):
    <kubelet dir>/plugins/models.weightcache.io/dra.sock                the DRAPlugin service (v1 and v1beta1)
                                                                        and DRAResourceHealth (v1alpha1)
    <kubelet dir>/plugins_registry/models.weightcache.io-reg.sock       the Registration service
    <kubelet dir>/plugins/models.weightcache.io/metadata/<claim uid>/   the claims' device metadata files

The DRA service starts first and the registration socket last, so kubelet never finds an endpoint that does not
answer; stopping goes the other way round. weightcache/daemon/dra.py wires it to the daemon (its store, its
policy, the cluster's ResourceClaims and ResourceSlices through the official client): the daemon composes the node
services, so none of them imports the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from weightcache.access import Authority
from weightcache.dra import DRIVER_NAME
from weightcache.dra._pb import (
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2_grpc,
)
from weightcache.dra.binding import ClaimBinder
from weightcache.dra.claims import ClaimBook
from weightcache.dra.eviction import ExtendedPodEvictor
from weightcache.dra.fetchable import Fetchable
from weightcache.dra.health import DeviceHealth, HealthServicer
from weightcache.dra.plugin import ClaimSource, DRAServicer, DRAServicerV1beta1, ModelClaims
from weightcache.dra.registration import RegistrationServicer
from weightcache.dra.slices import API_TIMEOUT_S, SlicePublisher
from weightcache.errors import ClusterError, ConfigError
from weightcache.store import Store
from weightcache.unixsock import claim_socket_path

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def plugin_socket(kubelet_dir: Path) -> Path:
    return kubelet_dir / "plugins" / DRIVER_NAME / "dra.sock"


def metadata_dir(kubelet_dir: Path) -> Path:
    """Where the device metadata files (weightcache/dra/metadata.py) live on the host."""
    return kubelet_dir / "plugins" / DRIVER_NAME / "metadata"


def registration_socket(kubelet_dir: Path) -> Path:
    return kubelet_dir / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"


@dataclass
class DraPlugin:
    """A running plugin; `await stop()` ends it."""

    dra_server: grpc.aio.Server
    registration_server: grpc.aio.Server
    registration: RegistrationServicer
    claims: ModelClaims
    sockets: tuple[Path, Path]  # (registration, plugin)
    publisher: SlicePublisher | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self, grace: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.registration_server.stop(grace)
        await self.dra_server.stop(grace)
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


async def serve_dra(*, store: Store, pool: str, kubelet_dir: Path, cdi_dir: Path, authority: Authority,
                    claims: ClaimSource, publisher: SlicePublisher | None = None,
                    publish_interval: float = 2.0, health_interval: float = 2.0,
                    fetchable: Callable[[str], Fetchable | None] | None = None,
                    binder: ClaimBinder | None = None, evictor: ExtendedPodEvictor | None = None) -> DraPlugin:
    """Reconcile prepared claims with the store's leases, then serve DRA and register with kubelet. `fetchable`
    maps a fetchable device's model key to its model (prepare of `f-` devices); `binder` answers their binding
    conditions (both 1.36+, docs/dra.md); `evictor` deletes the `dra-extended` pods on a damaged copy every
    `health_interval`."""
    book = ClaimBook(store.layout.tree)
    model_claims = ModelClaims(store, book, pool=pool, cdi_dir=cdi_dir, claims=claims, authority=authority,
                               fetchable=fetchable, metadata_dir=metadata_dir(kubelet_dir))
    await asyncio.to_thread(model_claims.reconcile)
    plugin_path, reg_path = plugin_socket(kubelet_dir), registration_socket(kubelet_dir)
    dra_server = grpc.aio.server()
    v1 = DRAServicer(model_claims)
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(v1, dra_server)  # type: ignore[no-untyped-call]
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DRAServicerV1beta1(v1), dra_server)  # type: ignore[no-untyped-call]
    health = DeviceHealth(store, book, published=publisher.published_names if publisher is not None else lambda: ())
    dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
        HealthServicer(health, pool=pool, interval=health_interval), dra_server)
    await _listen(dra_server, plugin_path)
    registration = RegistrationServicer(str(plugin_path))
    reg_server = grpc.aio.server()
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(registration, reg_server)  # type: ignore[no-untyped-call]
    try:
        await _listen(reg_server, reg_path)
    except BaseException:
        await dra_server.stop(None)
        raise
    plugin = DraPlugin(dra_server, reg_server, registration, model_claims, (reg_path, plugin_path), publisher)
    if publisher is not None:
        plugin._tasks.append(asyncio.create_task(publisher.run(publish_interval), name="dra-resourceslices"))
    if binder is not None:
        plugin._tasks.append(asyncio.create_task(binder.run(), name="dra-binding-conditions"))
    if evictor is not None:
        plugin._tasks.append(asyncio.create_task(_evict_forever(evictor, health_interval), name="dra-taint-eviction"))
    log.info("DRA driver %s serving on unix://%s, registration socket %s", DRIVER_NAME, plugin_path, reg_path)
    return plugin


async def _evict_forever(evictor: ExtendedPodEvictor, interval: float) -> None:
    while True:
        try:
            await asyncio.to_thread(evictor.sweep)
        except Exception:  # a bug or an unreachable API server must not end the loop: the next pass tries again
            log.exception("evicting pods from damaged model copies failed")
        await asyncio.sleep(interval)


async def _listen(server: grpc.aio.Server, path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes, the Unix limit; "
                          "use a shorter kubeletDir")
    claim_socket_path(path, change="kubeletDir")
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    os.chmod(path, 0o600)  # kubelet runs as root; nobody else has business here




def claim_reader(api_client: ApiClient, api_version: str = "v1") -> ClaimSource:
    """ResourceClaims through the official client; API failures become ClusterError (a per-claim error)."""
    import urllib3

    from weightcache.kube.client import ApiException, CustomObjectsApi

    api = CustomObjectsApi(api_client)

    def read(namespace: str, name: str) -> dict[str, Any]:
        try:
            claim: dict[str, Any] = api.get_namespaced_custom_object(
                "resource.k8s.io", api_version, namespace, "resourceclaims", name, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            raise ClusterError(f"reading ResourceClaim {namespace}/{name} failed: HTTP {exc.status} {exc.reason}; "
                               "kubelet retries", exc.status) from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # unreachable, reset, timed out
            raise ClusterError(f"reading ResourceClaim {namespace}/{name} failed: {type(exc).__name__}; the API "
                               "server did not answer; kubelet retries") from None
        return claim

    return read
