"""Typed configuration of the fleet front door (``[fleet]`` in the pipeline config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FleetConfig:
    layout: str = "cpu"  # each session's layout (pipeline/runtime/layouts.py): a bundle per TP rank + one for the decoder
    cpu_device_resource: str = "charstream_cpu"  # what CPU layouts reserve per device (GPU layouts reserve GPU)
    max_sessions_per_node: int = 2
    # A placement group on a node the accounting says is free, not placed by then: answer "full" (another
    # workload took the resources). 0.5 s refused the first sessions of a cold local cluster on a busy
    # 2-core host that had room for them; the accounting's own "full" needs no Ray call and stays immediate.
    reserve_timeout_s: float = 5.0
    start_timeout_s: float = 60.0  # the session actor's start: a worker process, imports, the node's egress
    retry_after_s: int = 5  # Retry-After of a "full" answer
    # The reference counts sessions averaging <= 24 of its 25 fps; charstream plays 24 fps, so the
    # same 4% short is 23.04: a session averaging at or below slow_fps counts against fleet health.
    slow_fps: float = 23.0
    health_min_seconds: float = 5.0  # a session's average counts once it has played this long
    health_history: int = 10_000  # ended sessions kept for the health share
    poll_interval_s: float = 0.5  # node liveness and session fps refresh
    # A session's actor may die before Ray marks its node dead: wait this long for the node's
    # verdict (at least Ray's node-death detection time) before calling it the process's death.
    node_loss_grace_s: float = 5.0
