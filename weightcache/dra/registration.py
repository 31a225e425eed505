"""kubelet plugin registration (pluginregistration.Registration): how kubelet finds the DRA service.

kubelet's plugin watcher sees our socket appear in `<kubelet dir>/plugins_registry/`, calls GetInfo, checks the
type and versions, connects to the endpoint we name, and reports the outcome with NotifyRegistrationStatus.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from weightcache.dra import DRIVER_NAME, SUPPORTED_VERSIONS
from weightcache.dra._pb import pluginregistration_pb2, pluginregistration_pb2_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # kubelet's pluginregistration DRAPlugin type


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):
    """`registered` is set once kubelet reports success; `error` holds kubelet's last refusal."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self.registered = asyncio.Event()
        self.error = ""

    async def GetInfo(self, request: pluginregistration_pb2.InfoRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pluginregistration_pb2.PluginInfo:
        return pluginregistration_pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=self._endpoint,
                                                 supported_versions=list(SUPPORTED_VERSIONS))

    async def NotifyRegistrationStatus(self, request: pluginregistration_pb2.RegistrationStatus,
                                       context: grpc.aio.ServicerContext[Any, Any]
                                       ) -> pluginregistration_pb2.RegistrationStatusResponse:
        if request.plugin_registered:
            self.error = ""
            self.registered.set()
            log.info("kubelet registered the DRA driver %s (endpoint %s)", DRIVER_NAME, self._endpoint)
        else:
            self.error = request.error
            self.registered.clear()
            log.error("kubelet refused the DRA driver %s: %s; check that kubelet is 1.32+ with DRA enabled and "
                      "that the plugin socket path is the one kubelet can reach", DRIVER_NAME, request.error)
        return pluginregistration_pb2.RegistrationStatusResponse()
