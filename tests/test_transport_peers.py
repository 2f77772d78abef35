"""Channel peers that run in spawned processes for the transport tests (no tests here)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator

import anyio
import numpy as np
import zmq

from charstream.transport.channel import HELLO, Receiver, Sender, Transport
from charstream.transport.config import TransportConfig
from charstream.transport.messages import Conditioning

SPAWN = multiprocessing.get_context("spawn")


@contextlib.contextmanager
def spawned(target: Callable[..., object], *args: object) -> Iterator[multiprocessing.Process]:
    """``target(*args)`` in a spawned process, killed and reaped on the way out."""
    peer = SPAWN.Process(target=target, args=args)
    peer.start()
    try:
        yield peer
    finally:
        peer.kill()
        peer.join()


def slow_consumer(endpoint: str, config: TransportConfig, capacity: int, count: int, delay_s: float) -> int:
    """Takes ``count`` messages, ``delay_s`` apart; returns the number of messages in order."""

    async def main() -> int:
        transport = Transport(config)
        in_order = 0
        async with Receiver(transport, endpoint, "producer->consumer", capacity) as rx:
            for i in range(count):
                msg = await rx.recv()
                in_order += msg.chunk == i
                await anyio.sleep(delay_s)
        transport.close()
        return in_order

    return anyio.run(main)


def idle_sender(endpoint: str, config: TransportConfig) -> None:
    """Says hello, then only heartbeats, forever (the test kills it)."""

    async def main() -> None:
        async with Sender(Transport(config), endpoint, "idle->rx", "idle"):
            await anyio.sleep_forever()

    anyio.run(main)


def slot_sender(endpoint: str, config: TransportConfig, size: int) -> None:
    """Sends one message of ``size`` float32s (through a shared-memory slot on ipc), then idles."""

    async def main() -> None:
        async with Sender(Transport(config), endpoint, "slotted->rx", "slotted") as tx:
            await tx.send(Conditioning("s", 0, np.ones(size, np.float32), np.zeros(8, np.int16), False))
            await anyio.sleep_forever()

    anyio.run(main)


def hello_sender(endpoint: str, geometry: bytes) -> None:
    """Says HELLO with ``geometry`` from a process of its own, then idles (the test kills it)."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.routing_id = b"other"
    sock.connect(endpoint)
    sock.send_multipart([HELLO, geometry])
    while True:
        sock.recv_multipart()
