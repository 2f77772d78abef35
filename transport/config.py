"""The transport's typed config section (``PipelineConfig.transport``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from charstream.config_checks import CheckedSection, within

MESSAGE_BYTES = within(4096, 2**31)  # zmq's size limit is twice max_message_bytes: it stays an int64


@dataclass
class TransportConfig(CheckedSection):
    SECTION = "transport"

    default_capacity: int = field(default=4, metadata=within(1, 1024))  # credits per edge, in messages
    # per edge name, overrides the default
    capacities: dict[str, int] = field(default_factory=dict, metadata=within(1, 1024))
    max_message_bytes: int = field(default=64 * 1024 * 1024, metadata=MESSAGE_BYTES)
    heartbeat_s: float = field(default=0.25, metadata=within(0.01, 60))
    # a peer silent this long is dead (kill -9 ends the session within 2 s)
    dead_after_s: float = field(default=1.5, metadata=within(0.05, 86_400))
    cross_process: str = "ipc"  # endpoints between processes: ipc (one host) | tcp
    tcp_host: str = "127.0.0.1"  # address tcp endpoints bind to; not loopback => CURVE is required
    curve: bool = False  # force CURVE on tcp even on loopback
    # ipc only: arrays of a message in [slot_min_bytes, slot_bytes] cross in a shared-memory slot
    # (capacity slots per edge); smaller ones are cheaper inline, larger ones go inline. 0 = off.
    # 32 MiB holds a FlashHead Pro chunk (28 frames of 512 x 512, 22 MB); a slot reserves only what
    # its largest message needed.
    slot_bytes: int = field(default=32 * 1024 * 1024, metadata=within(4096, 2**31, off=0))
    slot_min_bytes: int = field(default=64 * 1024, metadata=within(0, 2**31))

    def check_together(self) -> None:
        if self.dead_after_s <= self.heartbeat_s:  # every peer would be dead between two beats
            self.refuse("dead_after_s", f"{self.dead_after_s:g} must exceed {self.key('heartbeat_s')} "
                                        f"({self.heartbeat_s:g})")
