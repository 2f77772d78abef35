"""A local multi-node Ray cluster on one machine (several raylets, loopback only), as Ray's own tests do.

For the tests and the load test: each node advertises ``devices`` units of the CPU device
resource, so CPU sessions are placed exactly as GPU ones on real hosts (or, on a GPU machine,
its GPUs). Small on purpose (2 cores):
80 MB object store per node, one CPU each, no dashboard; node death is noticed in about a second
(health checks every 250 ms, 3 misses) instead of Ray's default ~15 s.
"""

from __future__ import annotations

from ray.cluster_utils import Cluster

# Ray rewrites 127.0.0.1 to the host's outbound address (so that other hosts can reach it); any
# other loopback address is left alone, and keeps a local cluster on loopback.
LOOPBACK = "127.0.0.2"
OBJECT_STORE_BYTES = 80 * 1024 * 1024
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 250,
                   "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


def local_cluster(devices: list[int], resource: str = "charstream_cpu") -> Cluster:
    """A cluster of ``len(devices)`` nodes (the first is the head) on ``LOOPBACK``, each offering its
    count of ``resource``; ``resource="GPU"`` offers this machine's GPUs (give each node its own)."""
    node = {"node_ip_address": LOOPBACK, "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}

    def offer(count: int) -> dict:
        return {"num_gpus": count} if resource == "GPU" else {"num_gpus": 0, "resources": {resource: count}}

    cluster = Cluster(initialize_head=True, head_node_args={
        **node, **offer(devices[0]), "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
    for count in devices[1:]:
        cluster.add_node(**node, **offer(count))
    cluster.wait_for_nodes()
    return cluster
