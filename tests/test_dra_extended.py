"""DRA extended resources (KEP-5004: beta in 1.36, stable in 1.37): a model's own DeviceClass names an extended
resource, the webhook's `weightcache.io/via: dra-extended` asks for one unit of it in `resources.limits` instead
of adding a claim, and the claim the scheduler then makes from the class passes the claim admission policy in a
granted namespace only. The class and the patched pod are checked against the official 1.36/1.37 schemas, the
class's CEL with cel-python against published devices, the extended resource name against Kubernetes' rules."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import celpy
import yaml

from tests.fixtures_dra import ALLOWED_NS, DraHarness, selected
from tests.fixtures_k8s_schema import validate_strict
from tests.fixtures_webhook import DRAFT, REF, admission_review, apply_response, deployment_pod
from tests.test_dra_claim_policy import FLEET, LLAMA, MISTRAL
from tests.test_dra_claim_policy import admit as vap_admit
from tests.test_dra_plugin import spec_file
from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import devices_for
from weightcache.dra.fetchable import Fetchable, fetchable_devices
from weightcache.dra.template import device_class, extended_resource_name
from weightcache.store import Snapshot
from weightcache.uri import model_key, parse_ref
from weightcache.webhook import dra_templates
from weightcache.webhook.mutate import review

ROOT = Path(__file__).resolve().parent.parent
OPEN = {"model_caches": [], "allow_undeclared": True}
# k8s.io/apimachinery validation: a qualified name (optional DNS-subdomain prefix <= 253, name <= 63) ...
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_PREFIX = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """pkg/apis/core/helper IsExtendedResourceName: fully qualified, not in the kubernetes.io domain, and
    `requests.<name>` a qualified name too (a ResourceQuota must be able to name it)."""
    prefix, slash, part = name.partition("/")
    native = not slash or prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io")
    return (not native and bool(_PREFIX.match(prefix)) and bool(_NAME_PART.match(part))
            and bool(_PREFIX.match("requests." + prefix)))


def selects(cls: dict[str, Any], device: dict[str, Any] | Any) -> bool:
    """The class's selectors ANDed, in order, as the scheduler evaluates them (a CEL value passes through)."""
    return selected([s["cel"]["expression"] for s in cls["spec"]["selectors"]], device)


def test_the_models_class_names_a_valid_extended_resource_and_selects_only_that_model(tmp_path: Path) -> None:
    cls = device_class(LLAMA, mount_path="/models/llama", env="LLAMA")
    for version in ("1.36", "1.37"):
        validate_strict(cls, version)
    name = cls["spec"]["extendedResourceName"]
    assert name == extended_resource_name(LLAMA, mount_path="/models/llama", env="LLAMA")
    assert name.startswith(f"{DRIVER_NAME}/{model_key(parse_ref(LLAMA).uri)}-") and is_extended_resource_name(name)
    assert not is_extended_resource_name("kubernetes.io/model") and not is_extended_resource_name("model")
    assert cls["metadata"]["name"] == "weightcache-" + name.partition("/")[2]  # the claim policy reads the name
    assert cls["spec"]["config"] == [{"opaque": {"driver": DRIVER_NAME, "parameters": {
        "mountPath": "/models/llama", "env": "LLAMA"}}}]
    assert device_class(LLAMA)["spec"]["extendedResourceName"] != name  # unique per class, as the API asks

    llama = Snapshot("a" * 40, tmp_path, LLAMA, None, 1)
    mistral = Snapshot("b" * 40, tmp_path, MISTRAL, None, 1)
    devices = devices_for([llama, mistral], slots=2, shared=False) + devices_for([llama], slots=4, shared=True)
    devices += fetchable_devices([Fetchable(parse_ref(LLAMA), 10, "llama"), Fetchable(parse_ref(MISTRAL), 10, "m")],
                                 held=())
    chosen = sorted(d["name"] for d in devices if selects(cls, d))
    assert chosen == sorted([f"m-{llama.id}-0", f"m-{llama.id}-1", f"m-{llama.id}",
                             f"f-{model_key(parse_ref(LLAMA).uri)}"])  # held, shared, or fetchable (1.36+)
    gpu = celpy.json_to_cel({"driver": "gpu.example.com", "capacity": {},
                             "attributes": {"gpu.example.com": {"model": model_key(parse_ref(LLAMA).uri)}}})
    assert not selects(cls, gpu)  # another driver's device with the same attribute value


def admit(pod: dict[str, Any], **policy: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    answer = review(admission_review(pod), **(policy or OPEN))
    patched = apply_response(pod, answer)
    if answer["response"]["allowed"]:
        validate_strict(patched, "1.37")
    return answer["response"], patched


def test_via_dra_extended_asks_for_the_models_extended_resource() -> None:
    response, pod = admit(deployment_pod({"weightcache.io/models": f"llama={REF},draft={DRAFT}",
                                          "weightcache.io/via": "dra-extended"}))
    assert response["allowed"], response
    wanted = {extended_resource_name(REF, mount_path="/models/llama", env="WEIGHTCACHE_MODEL_PATH_LLAMA"): "1",
              extended_resource_name(DRAFT, mount_path="/models/draft", env="WEIGHTCACHE_MODEL_PATH_DRAFT"): "1"}
    for c in pod["spec"]["containers"]:
        assert wanted.items() <= c["resources"]["limits"].items() and "nvidia.com/gpu" in c["resources"]["limits"]
        assert "claims" not in c["resources"]
    assert "resourceClaims" not in pod["spec"] and "affinity" not in pod["spec"]
    again, _ = admit(pod)
    assert "patch" not in again  # reinvocation adds nothing

    bare = deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra-extended",
                           "weightcache.io/placement": "gate"})
    for c in bare["spec"]["containers"]:
        c.pop("resources", None)
    _, gated = admit(bare)
    assert all(c["resources"] == {"limits": {extended_resource_name(REF): "1"}} for c in gated["spec"]["containers"])
    assert gated["spec"]["schedulingGates"] == [{"name": "weightcache.io/model"}]


def test_a_different_amount_already_asked_is_a_conflict() -> None:
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra-extended"})
    pod["spec"]["containers"][0].setdefault("resources", {}).setdefault("requests", {})[
        extended_resource_name(REF)] = "2"
    response, _ = admit(pod)
    assert not response["allowed"] and response["status"]["code"] == 409
    assert "one unit of its extended resource" in response["status"]["message"]


def test_a_missing_device_class_is_refused_with_the_command() -> None:
    classes: set[str] = set()
    dra_templates.install(None, lambda namespace, name: namespace == "" and name in classes)
    try:
        pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra-extended"})
        response, _ = admit(pod)
        assert not response["allowed"]
        message = response["status"]["message"]
        name = device_class(REF)["metadata"]["name"]
        assert f"DeviceClass {name} does not exist" in message
        assert f"python -m weightcache.dra.template {parse_ref(REF).uri} --device-class | kubectl apply -f -" in message
        classes.add(name)
        assert admit(pod)[0]["allowed"]
    finally:
        dra_templates.install(None, None)


def scheduler_claim(cls: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The claim the scheduler makes for a pod's extended resource: the class and nothing else."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "vllm-0-extended-resources-x7k2p", "namespace": namespace,
                         "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"}},
            "spec": {"devices": {"requests": [{"name": "container-0-request-0", "exactly": {
                "deviceClassName": cls["metadata"]["name"], "allocationMode": "ExactCount", "count": 1}}]}}}


def test_the_claim_policy_admits_the_schedulers_claim_only_where_granted() -> None:
    [policy] = [d for d in yaml.safe_load_all((ROOT / "deploy/dra/claim-policy.yaml").read_text())
                if d["kind"] == "ValidatingAdmissionPolicy"]
    llama = device_class(LLAMA, mount_path="/models/llama")
    ok = scheduler_claim(llama, "ml")
    validate_strict(ok, "1.37")
    assert vap_admit(policy, ok, FLEET) == (True, "allowed")
    allowed, message = vap_admit(policy, scheduler_claim(llama, "intruder"), FLEET)
    assert not allowed and "namespace 'intruder' is not in its spec.allowedNamespaces" in message
    anything = scheduler_claim({"metadata": {"name": "weightcache-any-model"}}, "ml")
    allowed, message = vap_admit(policy, anything, FLEET)
    assert not allowed and "without naming one model" in message


async def test_the_classs_config_reaches_prepare(dra: DraHarness) -> None:
    """The scheduler copies the class's opaque config into the allocation (source FromClass): the model is mounted
    where the class says."""
    await dra.kubelet.register()
    config = [{"source": "FromClass", "requests": [], "opaque": {
        "driver": DRIVER_NAME, "parameters": {"mountPath": "/models/llama", "env": "LLAMA_PATH"}}}]
    claim = dra.allocate(ALLOWED_NS, "ext", [dra.device(dra.snapshots[0], 0, request="container-0-request-0")],
                         config=config)
    uid = claim["metadata"]["uid"]
    assert (await dra.kubelet.prepare(claim)).claims[uid].error == ""
    [device] = json.loads(spec_file(dra, uid).read_text())["devices"]
    assert device["containerEdits"]["env"] == ["LLAMA_PATH=/models/llama"]
    assert device["containerEdits"]["mounts"][0]["containerPath"] == "/models/llama"
