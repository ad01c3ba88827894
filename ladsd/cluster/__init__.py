"""``ladsd cluster``: N ``ladsd serve`` replicas behind ``vllm-router`` (docs/scale-out.md).

* :mod:`ladsd.cluster.replicas`: a replica's command, its share of the cores, its process;
* :mod:`ladsd.cluster.router`: the router's flags (policy explicit, retries and circuit
  breaker off, health checks on ``/health``), readiness and worker removal;
* :mod:`ladsd.cluster.supervisor`: start, watch, report a death, drain on SIGTERM.

Nothing here imports vLLM or torch: the replicas do, in their own processes.
"""

from ladsd.cluster.replicas import OWNED_FLAGS, ReplicaSpec, core_shares
from ladsd.cluster.router import ROUTINGS, RouterSpec
from ladsd.cluster.supervisor import Cluster, ClusterSpec

__all__ = [
    "OWNED_FLAGS",
    "ROUTINGS",
    "Cluster",
    "ClusterSpec",
    "ReplicaSpec",
    "RouterSpec",
    "core_shares",
]
