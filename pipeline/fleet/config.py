"""Typed configuration of the fleet front door (``[fleet]`` in the pipeline config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from charstream.config_checks import CheckedSection, within


@dataclass
class FleetConfig(CheckedSection):
    SECTION = "fleet"

    layout: str = "cpu"  # each session's layout (pipeline/runtime/layouts.py): a bundle per TP rank + one for the decoder
    cpu_device_resource: str = "charstream_cpu"  # what CPU layouts reserve per device (GPU layouts reserve GPU)
    max_sessions_per_node: int = field(default=2, metadata=within(1, 10_000))
    # A placement group on a node the accounting says is free, not placed by then: answer "full" (another
    # workload took the resources). 0.5 s refused the first sessions of a cold local cluster on a busy
    # 2-core host that had room for them; the accounting's own "full" needs no Ray call and stays immediate.
    reserve_timeout_s: float = field(default=5.0, metadata=within(0.1, 3600))
    # the session actor's start: a worker process, imports, the node's egress
    start_timeout_s: float = field(default=60.0, metadata=within(1, 3600))
    retry_after_s: int = field(default=5, metadata=within(0, 3600))  # Retry-After of a "full" answer
    # The reference counts sessions averaging <= 24 of its 25 fps; charstream plays 24 fps, so the
    # same 4% short is 23.04: a session averaging at or below slow_fps counts against fleet health.
    slow_fps: float = field(default=23.0, metadata=within(0, 240))
    # a session's average counts once it has played this long
    health_min_seconds: float = field(default=5.0, metadata=within(0, 86_400))
    health_history: int = field(default=10_000, metadata=within(1, 10_000_000))  # ended sessions kept for the health share
    poll_interval_s: float = field(default=0.5, metadata=within(0.01, 60))  # node liveness and session fps refresh
    # A session's actor may die before Ray marks its node dead: wait this long for the node's
    # verdict (at least Ray's node-death detection time) before calling it the process's death.
    node_loss_grace_s: float = field(default=5.0, metadata=within(0, 3600))
