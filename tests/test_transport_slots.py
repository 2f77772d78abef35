"""Large arrays over ipc through per-edge shared-memory slots (transport/slots.py in the channel)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct

import anyio
import msgpack
import numpy as np
import pytest
import zmq
from test_transport_peers import slot_sender

from charstream.transport.channel import CREDIT, DATA, HELLO, SLOT, PeerDeadError, Receiver, Sender, Transport
from charstream.transport.codec import encode
from charstream.transport.config import TransportConfig
from charstream.transport.messages import Conditioning
from charstream.transport.slots import SlotBlock

SPAWN = multiprocessing.get_context("spawn")
MB = 1 << 20


def cond(i: int, floats: int) -> Conditioning:
    return Conditioning("s", i, np.full(floats, i, np.float32), np.arange(8, dtype=np.int16), False)


def in_dev_shm(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_large_arrays_cross_in_slots_and_outlive_slot_reuse(tmp_path):
    config = TransportConfig(slot_bytes=12 * MB)
    tokens = np.random.default_rng(0).random((9, 1024, 256), dtype=np.float32)  # 9.4 MB
    big = Conditioning("s", 0, tokens, np.arange(8, dtype=np.int16), True)

    async def main():
        transport = Transport(config)
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "a->b", 2) as rx:
            async with Sender(transport, rx.endpoint, "a->b", "a", capacity=2) as tx:
                name = tx.block.shm.name
                # small: inline; larger than a slot: inline; then the 2-slot ring wraps twice
                messages = [big, cond(1, 8), cond(2, 13 * MB // 4), *(cond(i, MB // 4) for i in range(3, 8))]
                got = []
                with anyio.fail_after(20):
                    for msg in messages:
                        await tx.send(msg)
                        got.append(await rx.recv())
                kept = got[3:]  # held by us while later messages reuse their slots
                assert in_dev_shm(name) and tx.stats.slotted == rx.stats.slotted == 6
            assert not in_dev_shm(name)  # the sender unlinked its block on close
        transport.close()
        first = got[0]
        assert first.audio_tokens.dtype == np.float32 and first.audio_tokens.shape == tokens.shape
        assert np.array_equal(first.audio_tokens, tokens) and np.array_equal(first.audio, big.audio)
        assert first.speaking and first.chunk == 0
        assert np.array_equal(got[1].audio_tokens, np.full(8, 1, np.float32))
        assert got[2].audio_tokens.shape == (13 * MB // 4,) and (got[2].audio_tokens == 2).all()
        for i, msg in enumerate(kept, 3):
            assert msg.chunk == i and (msg.audio_tokens == i).all()  # not overwritten by later messages
        assert rx.stats.bad == 0

    anyio.run(main)


def test_in_flight_never_exceeds_the_slots(tmp_path):
    count, capacity = 30, 3
    config = TransportConfig(slot_min_bytes=1024)

    async def main():
        transport = Transport(config)
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "fast->slow", capacity) as rx:
            async with Sender(transport, rx.endpoint, "fast->slow", "fast", capacity=capacity) as tx:
                async with anyio.create_task_group() as tg:

                    async def produce():
                        for i in range(count):
                            await tx.send(cond(i, 64 * 1024))
                            assert tx.in_flight <= capacity == tx.block.slots

                    tg.start_soon(produce)
                    with anyio.fail_after(20):
                        for i in range(count):
                            msg = await rx.recv()
                            assert msg.chunk == i and (msg.audio_tokens == i).all()  # no slot overrun
                            await anyio.sleep(0.004)
        transport.close()
        assert tx.stats.max_in_flight == capacity  # blocked by credits, never by a busy slot
        assert tx.stats.slotted == rx.stats.slotted == count

    anyio.run(main)


def test_bad_slot_references_are_counted_and_the_channel_keeps_working(tmp_path):
    async def main():
        transport = Transport(TransportConfig())
        block = SlotBlock(2, 4096)
        header, *arrays = encode(cond(0, 16))
        header = bytes(header)
        good = block.write(1, arrays)
        slot, total = struct.pack("<I", 0), struct.pack("<Q", 64)
        cases = [
            ("slot index out of range", [struct.pack("<I", 2) + good[4:], header], "outside 2 slots"),
            ("length over the slot", [slot + struct.pack("<Q", 4097), header], "outside 2 slots"),
            ("truncated reference", [slot + total[:3], header], "slot reference of 7 bytes"),
            ("length that disagrees with the header", [slot + total + total, header], "frame has"),
            ("missing header", [good], "expected 2"),
        ]
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "rogue->rx", 4) as rx:
            rogue = transport.ctx.socket(zmq.DEALER)
            rogue.routing_id = b"rogue"
            rogue.connect(rx.endpoint)
            await rogue.send_multipart([HELLO, block.geometry()])
            assert (await rogue.recv_multipart())[0] == CREDIT
            for n, (name, frames, expected) in enumerate(cases, 1):
                await rogue.send_multipart([SLOT, *frames])
                with anyio.fail_after(5):
                    while rx.stats.bad < n:
                        await anyio.sleep(0.005)
                assert expected in rx.stats.last_error and "'rogue'" in rx.stats.last_error, (name, rx.stats.last_error)
                with anyio.fail_after(5):
                    assert await rogue.recv_multipart() == [CREDIT, (1).to_bytes(4, "little")], name  # credit back
            await rogue.send_multipart([SLOT, good, header])
            await rogue.send_multipart([DATA, *[bytes(f) for f in encode(cond(1, 16))]])
            with anyio.fail_after(5):
                first, second = await rx.recv(), await rx.recv()
            assert first.chunk == 0 and (first.audio_tokens == 0).all() and second.chunk == 1
            assert rx.stats.received == 2 and rx.stats.slotted == 1 and rx.stats.bad == len(cases)
            rogue.close(0)
        block.close()
        transport.close()

    anyio.run(main)


def test_a_block_truncated_after_hello_is_a_bad_message_not_sigbus(tmp_path):
    async def main():
        transport = Transport(TransportConfig())
        block = SlotBlock(2, 64 * 1024)
        header, *arrays = encode(cond(0, 4096))
        ref = block.write(0, arrays)
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "rogue->rx", 4) as rx:
            rogue = transport.ctx.socket(zmq.DEALER)
            rogue.routing_id = b"rogue"
            rogue.connect(rx.endpoint)
            await rogue.send_multipart([HELLO, block.geometry()])
            assert (await rogue.recv_multipart())[0] == CREDIT
            os.ftruncate(block.shm._fd, 0)  # after the size was checked at HELLO
            await rogue.send_multipart([SLOT, ref, bytes(header)])
            with anyio.fail_after(5):
                while rx.stats.bad < 1:
                    await anyio.sleep(0.005)
            assert "was truncated under slot 0" in rx.stats.last_error and rx.stats.errors == 0
            await rogue.send_multipart([DATA, *[bytes(f) for f in encode(cond(1, 16))]])
            with anyio.fail_after(5):
                assert (await rx.recv()).chunk == 1  # the receiver (this process) lives on
            rogue.close(0)
        block.close()
        transport.close()

    anyio.run(main)


def test_a_bad_hello_geometry_is_refused_clearly(tmp_path):
    config = TransportConfig(max_message_bytes=MB)

    async def main():
        transport = Transport(config)
        small = SlotBlock(1, 4096)
        geometry = msgpack.unpackb(small.geometry())
        cases = [
            ("garbage", os.urandom(16), "not"),
            ("extra key", msgpack.packb({**geometry, "x": 1}), "keys name, slots, slot_bytes"),
            ("foreign name", msgpack.packb({**geometry, "name": "../etc"}), "bad shared-memory name"),
            ("no such block", msgpack.packb({**geometry, "name": "charstream-" + "0" * 16}), "cannot attach"),
            ("zero slots", msgpack.packb({**geometry, "slots": 0}), "bad slots 0"),
            ("slot over the message limit", msgpack.packb({**geometry, "slot_bytes": 2 * MB}), "bad slot_bytes"),
            ("block smaller than its geometry", msgpack.packb({**geometry, "slots": 4}), "holds 4096 bytes"),
        ]
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "rogue->rx", 4) as rx:
            rogue = transport.ctx.socket(zmq.DEALER)
            rogue.routing_id = b"rogue"
            rogue.connect(rx.endpoint)
            for n, (name, geometry_frame, expected) in enumerate(cases, 1):
                await rogue.send_multipart([HELLO, geometry_frame])
                with anyio.fail_after(5):
                    while rx.stats.bad < n:
                        await anyio.sleep(0.005)
                assert "hello refused" in rx.stats.last_error and expected in rx.stats.last_error, (name, rx.stats.last_error)
            assert b"rogue" not in rx._credit_out and not rx._blocks  # never registered, never granted
            assert await rogue.poll(100) == 0
            async with Sender(transport, rx.endpoint, "a->rx", "a") as tx:  # the channel still works
                await tx.send(cond(0, MB // 8))
                with anyio.fail_after(5):
                    assert (await rx.recv()).chunk == 0
            assert rx.stats.slotted == 1
            rogue.close(0)
        small.close()
        assert not in_dev_shm(geometry["name"])
        transport.close()

    anyio.run(main)


def test_a_sender_killed_with_sigkill_leaves_nothing_in_dev_shm(tmp_path):
    config = TransportConfig(heartbeat_s=0.1, dead_after_s=0.8)
    ep = f"ipc://{tmp_path}/kill.sock"

    async def main():
        transport = Transport(config)
        async with Receiver(transport, ep, "slotted->rx", 2) as rx:
            peer = SPAWN.Process(target=slot_sender, args=(ep, config, MB))
            peer.start()
            try:
                with anyio.fail_after(30):
                    msg = await rx.recv()
                assert (msg.audio_tokens == 1).all() and rx.stats.slotted == 1
                name = rx._blocks[b"slotted"].name
                assert in_dev_shm(name)
                os.kill(peer.pid, signal.SIGKILL)
                with pytest.raises(PeerDeadError, match="'slotted'"), anyio.fail_after(10):
                    await rx.recv()
                assert not in_dev_shm(name)  # the receiver unlinked the dead sender's block
            finally:
                peer.kill()
                peer.join()
        transport.close()

    anyio.run(main)


def test_a_receiver_closing_first_unlinks_and_the_sender_closes_cleanly(tmp_path):
    async def main():
        transport = Transport(TransportConfig())
        rx = Receiver(transport, f"ipc://{tmp_path}/e.sock", "a->b", 2)
        async with Sender(transport, rx.endpoint, "a->b", "a") as tx:
            async with rx:
                await tx.send(cond(0, MB // 4))
                with anyio.fail_after(5):
                    assert (await rx.recv()).chunk == 0
                name = tx.block.shm.name
            assert not in_dev_shm(name)  # the receiver could not know whether the sender was alive
        transport.close()

    anyio.run(main)
