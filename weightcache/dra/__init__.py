"""DRA kubelet plugin: cached models as devices the scheduler allocates (driver `models.weightcache.io`).

devices.py turns store snapshots into ResourceSlice devices, slices.py keeps this node's ResourceSlices current,
claims.py records prepared claims, cdi.py writes the CDI specs that bind-mount a snapshot into a container,
metadata.py the device metadata file (KEP-5304) mounted beside it, plugin.py is the DRA gRPC service kubelet calls,
registration.py the plugin-registration service, server.py starts them in the daemon. fetchable.py and binding.py
are the 1.36 binding conditions, states.py the device taints (eviction.py deletes the `dra-extended` pods on a
damaged copy, which the upstream controller does not see), health.py the health stream. template.py renders the
ResourceClaimTemplate a pod uses and a model's DeviceClass for extended resources. See docs/dra.md.
"""

from __future__ import annotations

from weightcache.vocabulary import DRA_DRIVER as DRIVER_NAME

CDI_KIND = DRIVER_NAME + "/model"
# The DRAPlugin services this plugin serves, as kubelet expects them in PluginInfo.supported_versions
# (k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1} DRAPluginService): v1 for kubelet 1.34+, v1beta1 for 1.32-1.33.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")

__all__ = ["CDI_KIND", "DRIVER_NAME", "SUPPORTED_VERSIONS"]
