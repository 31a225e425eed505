"""Placement: pods wait for their model outside kubelet (docs/placement.md).

    nodes.py       could this pod run on this node (selectors, affinity, taints, free GPUs): pure
    choice.py      which nodes fetch, which pods go, which nodes keep a model in RAM: pure
    lease.py       leader election on a coordination.k8s.io/v1 Lease
    controller.py  the loop: watches, demand ModelCaches, releases gated pods, progress Events
    command.py     wiring for `weightcache webhook --controller` (the webhook process hosts the controller)
"""

from weightcache.vocabulary import CONTROLLER, MANAGED_BY  # MANAGED_BY value on demand ModelCaches; Event source

__all__ = ["CONTROLLER", "MANAGED_BY"]
