"""CSI Identity service: who we are, that we have no controller, and whether the store is usable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import grpc

from weightcache import __version__
from weightcache.csi import DRIVER_NAME
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.errors import Observe, quiet_rpc
from weightcache.errors import ConfigError

__all__ = ["DRIVER_NAME", "IdentityServicer"]


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    """`check` raises when the node cannot serve volumes (store unreadable, index broken); it runs on `pool`
    (the plugin's own, so a busy node still answers the liveness probe)."""

    observe: Observe | None = None  # its calls are not timed: kubelet's liveness probe every few seconds

    def __init__(self, check: Callable[[], object], pool: Executor | None = None) -> None:
        self._check = check
        self._pool = pool

    @quiet_rpc
    async def GetPluginInfo(self, request: csi_pb2.GetPluginInfoRequest,
                            context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @quiet_rpc
    async def GetPluginCapabilities(
            self, request: csi_pb2.GetPluginCapabilitiesRequest, context: grpc.aio.ServicerContext[Any, Any],
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        # No CONTROLLER_SERVICE: ephemeral inline volumes need no provisioning or attach.
        return csi_pb2.GetPluginCapabilitiesResponse()

    @quiet_rpc
    async def Probe(self, request: csi_pb2.ProbeRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.ProbeResponse:
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._check)
        except Exception as exc:
            raise ConfigError(f"the weightcache store is not usable: {exc}; check the store's hostPath volume "
                              "and the daemon's log") from exc
        response = csi_pb2.ProbeResponse()
        response.ready.value = True
        return response
