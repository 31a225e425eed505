"""Kubernetes 1.36 API server rules the fake API server (tests/fake_apiserver.py) enforces beyond REST semantics,
each ported from the upstream source named at it (k8s.io/kubernetes at v1.36, the tree openshift/microshift vendors
under deps/github.com/openshift/kubernetes). docs/fake-apiserver.md lists them with what is not modelled.

  - RBAC (plugin/pkg/auth/authorizer/rbac/rbac.go, pkg/apis/rbac/v1/evaluation_helpers.go): ClusterRoles, Roles
    and their bindings from the shipped manifests; a request is allowed when one rule of a role bound to the
    caller matches its API group, resource[/subresource], verb and (when the rule lists them) name. The 403 text is
    responsewriters.ForbiddenStatusError's.
  - Granular ResourceClaim status authorization (pkg/registry/resource/utils.go AuthorizedForDeviceStatus and
    AuthorizedForBinding, called from pkg/registry/resource/resourceclaim/strategy.go; feature
    DRAResourceClaimGranularStatusAuthorization, beta and on in 1.36): changing `status.devices` needs the verb
    `associated-node:<verb>` (caller's pod-bound token names the node the claim is allocated on) or
    `arbitrary-node:<verb>` on `resourceclaims/driver` named by each driver whose entries change; changing
    `status.allocation` or `status.reservedFor` needs `resourceclaims/binding`. Refused with 422 Invalid.
  - ValidatingAdmissionPolicy (staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating): the shipped
    policies bound with Deny, their CEL evaluated with cel-python for each create and update a token's user sends; 403.
  - Canonical quantities (staging/src/k8s.io/apimachinery/pkg/api/resource/quantity.go, `Quantity.String` of a
    parsed value): what is stored is the canonical form, `5000000` -> `5M`, `1024Ki` -> `1Mi`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

NODE_NAME_KEY = "authentication.kubernetes.io/node-name"  # serviceaccount.NodeNameKey: the pod-bound token's node
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@dataclass(frozen=True)
class User:
    """An authenticated caller, as the token authenticator hands it to the authorizer."""

    name: str
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @staticmethod
    def service_account(namespace: str, name: str, *, node: str | None = None) -> User:
        """A ServiceAccount's pod-bound token; `node` is what its `authentication.kubernetes.io/node-name` says."""
        extra = ((NODE_NAME_KEY, (node,)),) if node else ()
        return User(f"system:serviceaccount:{namespace}:{name}",
                    ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"), extra)

    def extra_values(self, key: str) -> tuple[str, ...]:
        return dict(self.extra).get(key, ())


@dataclass(frozen=True)
class Attributes:
    """authorizer.Attributes of a resource request."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    def forbidden(self, user: User) -> str:
        """responsewriters.ForbiddenStatusError(...).Error() with an empty reason (RBAC gives none on a deny)."""
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        where = f"in the namespace {_q(self.namespace)}" if self.namespace else "at the cluster scope"
        qualified = f"{self.resource}.{self.group}" if self.group else self.resource
        named = f"{qualified} {_q(self.name)}" if self.name else qualified
        return (f"{named} is forbidden: User {_q(user.name)} cannot {self.verb} resource {_q(resource)} in API group "
                f"{_q(self.group)} {where}")


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'  # Go's %q for the plain text used here


@dataclass
class Rbac:
    """The RBAC authorizer over a set of roles and bindings (no aggregation, no escalation checks)."""

    cluster_roles: dict[str, list[Obj]] = field(default_factory=dict)
    roles: dict[tuple[str, str], list[Obj]] = field(default_factory=dict)
    bindings: list[Obj] = field(default_factory=list)

    @classmethod
    def from_manifests(cls, paths: Iterable[Path], *, namespace: str = "weightcache") -> Rbac:
        """The roles and bindings in these YAML files; namespaced objects without a namespace get `namespace`."""
        rbac = cls()
        for path in paths:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    rbac.add(doc, namespace=namespace)
        return rbac

    def add(self, doc: Obj, *, namespace: str = "default") -> None:
        kind, meta = doc.get("kind"), doc.get("metadata") or {}
        if kind == "ClusterRole":
            self.cluster_roles[meta["name"]] = list(doc.get("rules") or [])
        elif kind == "Role":
            self.roles[(meta.get("namespace", namespace), meta["name"])] = list(doc.get("rules") or [])
        elif kind in ("ClusterRoleBinding", "RoleBinding"):
            self.bindings.append({**doc, "metadata": {**meta, "namespace": meta.get("namespace", namespace)}})

    def without(self, resource: str) -> Rbac:
        """A copy whose rules no longer name `resource` (a test takes one grant away)."""
        def strip(rules: list[Obj]) -> list[Obj]:
            kept = [{**r, "resources": [x for x in r.get("resources") or [] if x != resource]} for r in rules]
            return [r for r in kept if r["resources"]]
        return Rbac({k: strip(v) for k, v in self.cluster_roles.items()},
                    {k: strip(v) for k, v in self.roles.items()}, list(self.bindings))

    def allows(self, user: User | None, attrs: Attributes) -> bool:
        if user is None or "system:masters" in user.groups:
            return True
        return any(_rule_matches(rule, attrs) for rule in self._rules_for(user, attrs.namespace))

    def _rules_for(self, user: User, namespace: str) -> Iterator[Obj]:
        for binding in self.bindings:
            namespace_of = binding["metadata"]["namespace"]
            if not any(_subject_matches(s, user, namespace_of) for s in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            if binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] != namespace:
                continue
            if ref.get("kind") == "ClusterRole":
                yield from self.cluster_roles.get(ref.get("name", ""), [])
            elif ref.get("kind") == "Role":
                yield from self.roles.get((binding["metadata"]["namespace"], ref.get("name", "")), [])


def _subject_matches(subject: Obj, user: User, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    if kind == "User":
        return user.name == subject.get("name")
    if kind == "Group":
        return subject.get("name") in user.groups
    return False


def _rule_matches(rule: Obj, attrs: Attributes) -> bool:
    """rbacv1helpers.VerbMatches, APIGroupMatches, ResourceMatches and ResourceNameMatches."""
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    verbs, groups, resources = rule.get("verbs") or [], rule.get("apiGroups") or [], rule.get("resources") or []
    names = rule.get("resourceNames") or []
    return ((("*" in verbs) or attrs.verb in verbs)
            and (("*" in groups) or attrs.group in groups)
            and any(r in ("*", combined) or (attrs.subresource and r == f"*/{attrs.subresource}") for r in resources)
            and (not names or attrs.name in names))


def shipped_rbac() -> Rbac:
    """The roles and bindings `kubectl apply -k deploy/dra` installs (the daemon's and the DRA plugin's)."""
    return Rbac.from_manifests([DEPLOY / "daemonset" / "rbac.yaml", DEPLOY / "dra" / "rbac.yaml"])


def daemon_user(node: str) -> User:
    """The node daemon's pod-bound ServiceAccount token on `node`."""
    return User.service_account("weightcache", "weightcache-daemon", node=node)


# granular ResourceClaim status authorization ----------------------------------------------------------------------
ASSOCIATED_NODE, ARBITRARY_NODE = "associated-node:", "arbitrary-node:"  # resourcev1.VerbPrefix*


def _device_key(entry: Obj) -> tuple[str, str, str, str]:
    return (str(entry.get("driver")), str(entry.get("pool")), str(entry.get("device")), str(entry.get("shareID") or ""))


def modified_drivers(new: Obj, old: Obj) -> list[str]:
    """getModifiedDrivers: the drivers whose `status.devices` entries were added, removed or changed."""
    before = {_device_key(d): d for d in old.get("devices") or []}
    drivers = set()
    for entry in new.get("devices") or []:
        if before.pop(_device_key(entry), None) != entry:
            drivers.add(str(entry.get("driver")))
    drivers.update(str(d.get("driver")) for d in before.values())
    return sorted(drivers)


def allocated_node(allocation: Obj | None) -> str:
    """nodeNameFromAllocation: the node of a node-local allocation (one term, one matchFields metadata.name In)."""
    terms = ((allocation or {}).get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    if len(terms) != 1 or terms[0].get("matchExpressions") or len(terms[0].get("matchFields") or []) != 1:
        return ""
    f = terms[0]["matchFields"][0]
    if f.get("key") != "metadata.name" or f.get("operator") != "In" or len(f.get("values") or []) != 1:
        return ""
    return str(f["values"][0])


def claim_status_errors(rbac: Rbac, user: User | None, verb: str, namespace: str, new: Obj,
                        old: Obj) -> list[tuple[str, str]]:
    """(field, detail) of each field.Forbidden that AuthorizedForBinding and AuthorizedForDeviceStatus return."""
    errors: list[tuple[str, str]] = []
    if user is None:
        return errors
    if new.get("allocation") != old.get("allocation") or new.get("reservedFor") != old.get("reservedFor"):
        attrs = Attributes(verb, "resource.k8s.io", "resourceclaims", "binding")
        if not rbac.allows(user, attrs):
            errors.append(("status.allocation", 'changing status.allocation or status.reservedFor requires '
                           f'resource="resourceclaims/binding", verb="{verb}" permission: {attrs.forbidden(user)}'))
    if not new.get("allocation"):
        return errors  # the strategy authorizes device status only while the claim is allocated
    node = allocated_node(new["allocation"])
    bound = user.extra_values(NODE_NAME_KEY)
    associated = user.name.startswith("system:serviceaccount:") and len(bound) == 1 and bound[0] == node != ""
    verbs = [ASSOCIATED_NODE + verb, ARBITRARY_NODE + verb] if associated else [ARBITRARY_NODE + verb]
    for driver in modified_drivers(new, old):
        tried = [Attributes(v, "resource.k8s.io", "resourceclaims", "driver", namespace, driver) for v in verbs]
        if not any(rbac.allows(user, a) for a in tried):
            errors.append(("status.devices", 'changing status.devices requires resource="resourceclaims/driver", '
                           f'verb="[{" ".join(verbs)}]" permission: {tried[0].forbidden(user)}'))
    return errors


def drop_deallocated_devices(new: Obj, old: Obj) -> None:
    """dropDeallocatedStatusDevices: `status.devices` entries of devices no longer allocated go."""
    def allocated(status: Obj) -> set[tuple[str, str, str, str]]:
        results = (((status.get("allocation") or {}).get("devices") or {}).get("results")) or []
        return {_device_key(r) for r in results}
    gone = allocated(old) - allocated(new)
    if gone and new.get("devices"):
        new["devices"] = [d for d in new["devices"] if _device_key(d) not in gone]
        if not new["devices"]:
            del new["devices"]


# canonical quantities ---------------------------------------------------------------------------------------------
_QUANTITY = re.compile(r"^([+-]?)(\d*)(?:\.(\d*))?(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class QuantityError(ValueError):
    pass


def canonical_quantity(text: str) -> str:
    """resource.MustParse(text).String(): the value rounded up to nano units, written with the largest suffix of
    its format (binary for `Ki`..`Ei` inputs at least 1024 and whole, else decimal SI or `eN`) that keeps the
    mantissa whole."""
    m = _QUANTITY.match(text.strip()) if isinstance(text, str) else None
    if not m or not (m.group(2) or m.group(3)):
        raise QuantityError("quantities must match the regular expression "
                            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
    sign, whole, frac, suffix = m.group(1), m.group(2) or "0", m.group(3) or "", m.group(4) or ""
    value = Fraction(int(whole + frac or "0"), 10 ** len(frac))
    if suffix in _BINARY:
        value *= 1024 ** _BINARY[suffix]
        fmt = "binary"
    elif suffix[:1] in ("e", "E"):
        value *= Fraction(10) ** int(suffix[1:])
        fmt = "exponent"
    else:
        value *= Fraction(10) ** _DECIMAL[suffix]
        fmt = "decimal"
    if sign == "-":
        value = -value
    nanos = -((-value * 10 ** 9) // 1)  # round up to 1e-9, as the API server does
    if fmt == "binary" and abs(nanos) >= 1024 * 10 ** 9 and nanos % 10 ** 9 == 0:
        n, exp = nanos // 10 ** 9, 0
        while n % 1024 == 0 and exp < 6:
            n, exp = n // 1024, exp + 1
        return f"{n}{['', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei'][exp]}"
    n, exp = int(nanos), -9
    if n == 0:
        return "0"
    while n % 1000 == 0 and exp < 18:
        n, exp = n // 1000, exp + 3
    if fmt == "exponent":
        return f"{n}e{exp}" if exp else str(n)
    return f"{n}{ {v: k for k, v in _DECIMAL.items()}[exp]}"


def _canonical_in(parent: Obj | None, key: str) -> None:
    if isinstance(parent, dict) and isinstance(parent.get(key), str):
        parent[key] = canonical_quantity(parent[key])


def canonicalize_slice(obj: Obj) -> None:
    """Every Quantity of a ResourceSlice, as stored: capacities and their request policies, shared counters and the
    counters devices consume."""
    spec = obj.get("spec") or {}
    for counter_set in spec.get("sharedCounters") or []:
        for counter in (counter_set.get("counters") or {}).values():
            _canonical_in(counter, "value")
    for device in spec.get("devices") or []:
        for capacity in (device.get("capacity") or {}).values():
            _canonical_in(capacity, "value")
            policy = (capacity or {}).get("requestPolicy") or {}
            _canonical_in(policy, "default")
            if isinstance(policy.get("validValues"), list):
                policy["validValues"] = [canonical_quantity(v) for v in policy["validValues"]]
            for key in ("min", "max", "step"):
                _canonical_in(policy.get("validRange"), key)
        for consumed in device.get("consumesCounters") or []:
            for counter in (consumed.get("counters") or {}).values():
                _canonical_in(counter, "value")


def canonicalize_claim(obj: Obj) -> None:
    """A ResourceClaim's (or a template's inner spec's) capacity requests and the allocation's consumed capacity."""
    spec = obj.get("spec") or {}
    for request in (spec.get("devices") or {}).get("requests") or []:
        for sub in [request.get("exactly") or {}, *(request.get("firstAvailable") or [])]:
            requests = (sub.get("capacity") or {}).get("requests") or {}
            for name in list(requests):
                requests[name] = canonical_quantity(requests[name])
    results = ((((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []
    for result in results:
        consumed = result.get("consumedCapacity") or {}
        for name in list(consumed):
            consumed[name] = canonical_quantity(consumed[name])


# ValidatingAdmissionPolicy ----------------------------------------------------------------------------------------
def policy_denials(policy: Obj, request: Obj) -> list[str]:
    """The messages of `policy`'s failed validations for an AdmissionRequest-shaped `request` ([] = admitted), as
    staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating evaluates it: a request outside
    matchConstraints.resourceRules, or for which a matchCondition is false, is not this policy's business;
    variables are evaluated in order (upstream lazily, the same values); messageExpression wins over message."""
    import celpy
    from celpy.adapter import json_to_cel

    from tests.fixtures_crd_cel import cel_eval

    spec = policy["spec"]
    if not _policy_matches(spec.get("matchConstraints") or {}, request):
        return []

    def cel_map(values: dict[str, Any]) -> Any:  # already CEL values: json_to_cel would turn a BoolType into an int
        return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})

    activation: dict[str, Any] = {k: json_to_cel(request.get(k)) for k in ("object", "oldObject")}
    activation["request"] = json_to_cel(request)
    if not all(cel_eval(c["expression"], activation) for c in spec.get("matchConditions") or []):
        return []
    variables: dict[str, Any] = {}
    for v in spec.get("variables") or []:
        variables[v["name"]] = cel_eval(v["expression"], {**activation, "variables": cel_map(variables)})
    activation["variables"] = cel_map(variables)
    return [str(cel_eval(v["messageExpression"], activation)) if v.get("messageExpression") else v.get("message", "")
            for v in spec["validations"] if not cel_eval(v["expression"], activation)]


def _policy_matches(constraints: Obj, request: Obj) -> bool:
    """matchConstraints.resourceRules (apiGroups, apiVersions, resources with `/subresource`, operations)."""
    res = request.get("resource") or {}
    sub = request.get("subResource") or ""
    combined = f"{res.get('resource')}/{sub}" if sub else res.get("resource")
    return any(("*" in r.get("apiGroups", []) or res.get("group") in r.get("apiGroups", []))
               and ("*" in r.get("apiVersions", []) or res.get("version") in r.get("apiVersions", []))
               and ("*" in r.get("resources", []) or combined in r.get("resources", []))
               and ("*" in r.get("operations", []) or request.get("operation") in r.get("operations", []))
               for r in constraints.get("resourceRules") or [])


@dataclass
class AdmissionPolicies:
    """ValidatingAdmissionPolicies bound with `validationActions: [Deny]`, from the shipped manifests."""

    policies: list[Obj] = field(default_factory=list)

    @classmethod
    def from_manifests(cls, paths: Iterable[Path]) -> AdmissionPolicies:
        docs = [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]
        denying = {d["spec"]["policyName"] for d in docs if d.get("kind") == "ValidatingAdmissionPolicyBinding"
                   and "Deny" in d["spec"].get("validationActions", [])}
        return cls([d for d in docs if d.get("kind") == "ValidatingAdmissionPolicy"
                    and d["metadata"]["name"] in denying])

    def denial(self, request: Obj) -> str | None:
        """The 403 message of the first policy that denies `request` (validating/dispatcher.go: `ValidatingAdmission
        Policy '%s' with binding '%s' denied request: %s`; the shipped bindings share their policy's name)."""
        for policy in self.policies:
            failed = policy_denials(policy, request)
            if failed:
                name = policy["metadata"]["name"]
                return f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request: {failed[0]}"
        return None


def admission_request(user: User | None, operation: str, group: str, version: str, resource: str, subresource: str,
                      new: Obj, old: Obj | None) -> Obj:
    """The AdmissionRequest fields a policy's CEL reads (`request`, `object`, `oldObject`)."""
    info = {"username": user.name, "groups": list(user.groups), "extra": {k: list(v) for k, v in user.extra}} \
        if user is not None else {"username": "system:admin", "groups": ["system:masters"], "extra": {}}
    return {"operation": operation, "resource": {"group": group, "version": version, "resource": resource},
            "subResource": subresource, "userInfo": info, "object": new, "oldObject": old}


def shipped_policies() -> AdmissionPolicies:
    """The daemon's own-node policies (Node and ModelCacheNode writes, Events) `kubectl apply -k deploy/daemonset`
    installs."""
    return AdmissionPolicies.from_manifests([DEPLOY / "daemonset" / "node-policy.yaml"])
