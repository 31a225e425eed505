"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's rules.

    no Lease            -> create it holding it (409: another candidate was first)
    held by another     -> wait until its record (holder, renewTime) has not changed for leaseDurationSeconds
                           as measured on OUR clock (no trust in the other's clock), then take it over by an
                           update carrying the resourceVersion we read (409: someone else won)
    held by us          -> renew every retry_period; a leader that could not renew within renew_deadline
                           stops acting at once (renew_deadline < lease_duration: it stops before anyone
                           else may take over)
    stop()              -> release: holderIdentity emptied, so a successor need not wait out the lease
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3

from weightcache.kube.client import ApiClient, ApiException, CoordinationV1Api

log = logging.getLogger(__name__)


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, api_client: ApiClient, *, namespace: str, name: str, identity: str,
                 lease_duration: float = 15.0, renew_deadline: float = 10.0, retry_period: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the monotonic clock every duration is measured on (a test's held one)."""
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("leader election needs retry_period < renew_deadline < lease_duration")
        self._api = CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self._clock = clock
        self._renewed = -1e18  # monotonic time of our last successful acquire or renew
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) of another holder's record
        self._observed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.transitions = 0  # times this candidate became leader

    def is_leader(self) -> bool:
        return self._clock() - self._renewed < self.renew_deadline

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if release and self.is_leader():
            self._renewed = -1e18
            try:
                self.try_acquire_or_renew(release=True)
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                log.warning("releasing Lease %s/%s failed (%s); the next leader waits it out",
                            self.namespace, self.name, type(exc).__name__)

    def _run(self) -> None:
        while not self._stop.is_set():
            was = self.is_leader()
            try:
                self.try_acquire_or_renew()
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                log.warning("Lease %s/%s: %s", self.namespace, self.name,
                            f"HTTP {exc.status}" if isinstance(exc, ApiException) else type(exc).__name__)
            if self.is_leader() != was:
                log.info("%s %s leadership (Lease %s/%s)", self.identity,
                         "acquired" if self.is_leader() else "lost", self.namespace, self.name)
            self._stop.wait(self.retry_period)

    def try_acquire_or_renew(self, release: bool = False) -> bool:
        """One round; True when we hold the Lease afterwards. Leadership counts from before the request was sent:
        the server may have recorded it any time after."""
        sent, now = self._clock(), _micro_now()
        try:
            lease = json.loads(self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False).data)
        except ApiException as exc:
            if exc.status != 404 or release:
                raise
            return self._create(sent, now)
        spec: dict[str, Any] = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        if release:
            if holder == self.identity:
                self._replace(lease, {**spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now})
            return False
        if holder and holder != self.identity and self._still_held(holder, spec):
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        acquired = spec.get("acquireTime") if holder == self.identity else now
        if not self._replace(lease, self._spec(str(acquired or now), now, transitions)):
            return False
        if holder != self.identity:
            self._took(sent)
        self._renewed = sent
        return True

    def _create(self, sent: float, now: str) -> bool:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(now, now, 0)}
        try:
            self._api.create_namespaced_lease(self.namespace, body, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._took(sent)
        return True

    def _still_held(self, holder: str, spec: dict[str, Any]) -> bool:
        """Another holder's Lease is held until its record (holder, renewTime) stays unchanged for its duration on
        our own clock (clocks of two hosts are never compared)."""
        record = (holder, str(spec.get("renewTime") or ""))
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
        duration = spec.get("leaseDurationSeconds")
        return self._clock() - self._observed_at < (duration if isinstance(duration, int) and duration > 0 else 1)

    def _took(self, sent: float) -> None:
        self._renewed = sent
        self._observed = None
        self.transitions += 1

    def _spec(self, acquired: str, renewed: str, transitions: int) -> dict[str, Any]:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration),
                "acquireTime": acquired, "renewTime": renewed, "leaseTransitions": transitions}

    def _replace(self, lease: dict[str, Any], spec: dict[str, Any]) -> bool:
        """Optimistic update: the resourceVersion we read makes a concurrent writer's change win (409)."""
        body = {**lease, "spec": spec}
        try:
            self._api.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True
