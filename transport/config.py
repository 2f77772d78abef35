"""The transport's typed config section (``PipelineConfig.transport``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransportConfig:
    default_capacity: int = 4  # credits per edge, in messages
    capacities: dict[str, int] = field(default_factory=dict)  # per edge name, overrides the default
    max_message_bytes: int = 64 * 1024 * 1024
    heartbeat_s: float = 0.25
    dead_after_s: float = 1.5  # a peer silent this long is dead (kill -9 ends the session within 2 s)
    cross_process: str = "ipc"  # endpoints between processes: ipc (one host) | tcp
    tcp_host: str = "127.0.0.1"  # address tcp endpoints bind to; not loopback => CURVE is required
    curve: bool = False  # force CURVE on tcp even on loopback
    # ipc only: arrays of a message in [slot_min_bytes, slot_bytes] cross in a shared-memory slot
    # (capacity slots per edge); smaller ones are cheaper inline, larger ones go inline. 0 = off.
    slot_bytes: int = 16 * 1024 * 1024
    slot_min_bytes: int = 64 * 1024
