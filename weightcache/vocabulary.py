"""The names other parts and other tools rely on, defined once here and imported upward (docs/architecture.md).

The webhook that adds a gate and the controller that removes it, the daemon that sets a readiness label and the
webhook that requires it, the CSI plugin and the manifests that name its driver: each reads the name from here,
so no two layers can drift apart. Nothing here imports anything.
"""

# Kubernetes API group of the ModelCache and ModelCacheNode resources (CRDs in deploy/daemonset/).
GROUP = "weightcache.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MODELCACHES = "modelcaches"
MODELCACHE_KIND = "ModelCache"
MODELCACHENODES = "modelcachenodes"
MODELCACHENODE_KIND = "ModelCacheNode"

# Driver names: the CSI plugin's, and the DRA driver's (its DeviceClass and ResourceSlices).
CSI_DRIVER = "csi.weightcache.io"
DRA_DRIVER = "models.weightcache.io"

# Pod annotations all start with this (weightcache/pods/annotations.py names each key; the keys a layer below pods/
# or beside it reads are named here too).
ANNOTATION_PREFIX = f"{GROUP}/"
MODEL_ANNOTATION = f"{ANNOTATION_PREFIX}model"  # also on the ResourceClaims dra/template.py writes
VIA_ANNOTATION = f"{ANNOTATION_PREFIX}via"  # csi | dra | dra-extended: webhook.dra_claim, placement.choice
# A model's node label: READINESS_LABEL_PREFIX + its model key (uri.readiness_label), set to READY by the daemon of
# each node that holds it; the webhook's node affinity and the placement controller read it.
READINESS_LABEL_PREFIX = f"{GROUP}/"
READY = "ready"
# The scheduling gate the webhook adds to a pod whose model is ready on no node, and the controller removes.
GATE = f"{GROUP}/model"

# Who owns the demand ModelCaches the placement controller writes (label MANAGED_BY = CONTROLLER).
MANAGED_BY = "app.kubernetes.io/managed-by"
CONTROLLER = "weightcache-placement"

# Store lease holders: a mounted CSI volume (`csi:<volume>`), a prepared DRA claim (`dra:<claim uid>/<device>`), a
# LoRA adapter linked into a pod's adapter directory (`adapter:<volume>/<adapter name>`, docs/adapters.md).
CSI_HOLDER_PREFIX = "csi:"
DRA_HOLDER_PREFIX = "dra:"
ADAPTER_HOLDER_PREFIX = "adapter:"

# LoRA adapters (docs/adapters.md): the CSI volume attribute of a pod's adapter directory (`adapters: "true"`, with
# `model` naming the base model), and the environment variable that tells the pod's engine where it is mounted (the
# vLLM plugin's LoRA resolver reads it: packages/weightcache-vllm/weightcache_vllm/lora_resolver.py).
ADAPTERS_ATTRIBUTE = "adapters"
ADAPTERS_PATH_ENV = "WEIGHTCACHE_ADAPTERS_PATH"

# The model key (weightcache.uri.model_key of the canonical source) a ModelCache carries as a label, so the DRA
# claim admission policy (deploy/dra/claim-policy.yaml) can match claims to it: CEL cannot hash spec.source.
MODEL_KEY_LABEL = f"{GROUP}/model-key"
SIZE_BYTES_ANNOTATION = f"{GROUP}/size-bytes"  # a ModelCache's selected bytes: `prefetch --cluster` writes it, the DRA
#   driver's fetchable devices consume it from the node's counter (docs/dra.md)

# An engine's compile cache handed to a pod (docs/engine-caches.md): the CSI volume attribute the webhook writes and
# the plugin reads (`engineCache: vllm-0.32.0-cpu`), and the file a pod writes at that volume's root once its engine
# has served; only a volume that started empty and holds it is handed over when the pod ends.
ENGINE_CACHE_ATTRIBUTE = "engineCache"
# The store reference scheme of an engine cache (no model door parses it), and the trust domain of one the node's
# admin put: the only domain a peer serves and a node takes from a peer (weightcache/peers/server.py).
ENGINE_CACHE_SCHEME = "weightcache-engine-cache"
ENGINE_CACHE_ADMIN_DOMAIN = "_admin"
ENGINE_CACHE_READY = ".weightcache-ready"

# A pod that loads shards while the rest downloads (docs/streaming-pods.md): the CSI volume attribute the webhook
# writes (`stream: "true"`) from the pod annotation, and the state file at the root of the growing read-only view
# the plugin publishes. The state is JSON, replaced whole (tmp + rename): {"state": STREAM_FETCHING |
# STREAM_COMPLETE | STREAM_FAILED, "files": [relpaths the volume will hold] or null while the listing is not in
# hand, "error": text or null}. A file appears in the view whole (a hard link) and never changes.
STREAM_ATTRIBUTE = "stream"
STREAM_ANNOTATION = f"{GROUP}/stream"
STREAM_DIR = ".weightcache"  # reserved at the view's root: a model's own files under this name are left out
STREAM_STATE = f"{STREAM_DIR}/state"
STREAM_FETCHING, STREAM_COMPLETE, STREAM_FAILED = "fetching", "complete", "failed"

# What verified each file's bytes against its source, as a manifest's "checks" records it and `ls -o json`,
# `verify` and the policy requireSourceChecksum read it (docs/fetch.md, "What verified a file"): the store's own
# SHA-256 or a digest the source names (an OCI layer, the hub's LFS sha256), a full-object CRC, a full-object MD5 a
# gs:// or az:// listing carries, the single-part MD5 ETag, the multipart ETag (MD5 of the part MD5s), a *.sha256 /
# SHA256SUMS file beside it, or nothing.
# What the webhook does with a weightcache.io/ annotation key it does not know (pods/unknown_keys.py; the webhook's
# --unknown-annotations, whose parser every CLI command builds without importing the pods package).
UNKNOWN_ANNOTATION_MODES = ("warn", "deny")  # pods.unknown_keys.Mode spells them as a type

SOURCE_CHECKS = ("sha256", "crc64nvme", "crc32c", "crc32", "md5", "md5-etag", "multipart-md5", "sidecar", "none")
NO_SOURCE_CHECK = "none"

# The startup taint a node pool puts on new nodes (Karpenter `startupTaints`, cluster-autoscaler `--startup-taint`)
# and the node's own daemon removes once the ModelCaches that select the node with `spec.warmBeforeSchedulable` are
# on it, or at `startupTaintDeadline` (docs/startup-taint.md). deploy/daemonset/node-policy.yaml names it too.
STARTUP_TAINT = f"{GROUP}/models-pending"
STARTUP_TAINT_EFFECT = "NoSchedule"
# Cold-start stages the CSI plugin times per published model volume, from kubelet's first NodePublishVolume for it
# (retries included): the model on the node (a cache hit, or its fetch), the volume published. The label values of
# weightcache_coldstart_stage_seconds{stage} (daemon/metrics.py) and the words of the publish log line.
STAGE_MODEL_ON_NODE = "model_on_node"
STAGE_VOLUME_PUBLISHED = "volume_published"
# The stages a pod's engine reports about itself (the weightcache vLLM plugin, packages/weightcache-vllm): in the
# report file it writes at the root of its engine-cache volume (docs/telemetry.md), which the CSI plugin reads
# while the pod runs and when it ends, turning each stage into an Event on the pod and an observation of the same
# histogram. The report's `compile.result`: what the engine did with the compile cache it was handed.
STAGE_WEIGHTS_LOADED = "weights_loaded"
STAGE_ENGINE_READY = "engine_ready"
STAGE_FIRST_TOKEN = "first_token"
ENGINE_STAGES = (STAGE_WEIGHTS_LOADED, STAGE_ENGINE_READY, STAGE_FIRST_TOKEN)
ENGINE_REPORT = ".weightcache-report"
# A pod without an engine-cache volume reports into a report volume instead (`weightcache.io/telemetry: "true"`):
# the CSI volume attribute the webhook writes (`report: "true"`, with `model` naming the pod's model) for a small
# writable tmpfs the plugin reads as it reads an engine-cache volume's report, and the variable that tells the pod's
# engine where it is mounted (the vLLM plugin prefers it to the engine-cache volume's).
REPORT_ATTRIBUTE = "report"
REPORT_DIR_ENV = "WEIGHTCACHE_REPORT_DIR"
COMPILE_HIT, COMPILE_MISS, COMPILE_INCOMPATIBLE = "hit", "miss", "incompatible"
COMPILE_RESULTS = (COMPILE_HIT, COMPILE_MISS, COMPILE_INCOMPATIBLE)
