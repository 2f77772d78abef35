"""Large arrays over ipc through per-edge shared-memory slots (transport/slots.py in the channel)."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys

import anyio
import msgpack
import numpy as np
import pytest
import zmq
from test_transport_peers import hello_sender, slot_sender, spawned

from charstream.transport.channel import CREDIT, DATA, HELLO, SLOT, PeerDeadError, Receiver, Sender, Transport
from charstream.transport.codec import encode
from charstream.transport.config import TransportConfig
from charstream.transport.messages import Conditioning
from charstream.transport.slots import SEALS, ReceiveBuffers, SlotBlock, mapped_blocks

MB = 1 << 20


def cond(i: int, floats: int) -> Conditioning:
    return Conditioning("s", i, np.full(floats, i, np.float32), np.arange(8, dtype=np.int16), False)


def test_a_slot_reserves_what_its_largest_message_needs_not_its_size():
    """Shared memory is reserved before a page is touched (never SIGBUS), but only as far as the
    messages written need: a slot sized for a 22 MB chunk costs a 1 MB message 1 MB."""
    block = SlotBlock(2, 32 * MB)

    def reserved_mb() -> float:
        return os.fstat(block.fd).st_blocks * 512 / MB

    assert reserved_mb() == 0
    block.write(0, [memoryview(np.ones(MB, np.uint8))])
    assert reserved_mb() == 1
    block.write(0, [memoryview(np.ones(3 * MB, np.uint8))])  # a larger message in the same slot
    block.write(1, [memoryview(np.ones(MB // 2, np.uint8)), memoryview(np.ones(MB // 2, np.uint8))])
    assert reserved_mb() == 4
    block.write(0, [memoryview(np.ones(MB, np.uint8))])  # a smaller one: nothing more
    assert reserved_mb() == 4
    block.close()


def test_large_arrays_cross_in_slots_and_outlive_slot_reuse(tmp_path):
    config = TransportConfig(slot_bytes=12 * MB)
    tokens = np.random.default_rng(0).random((9, 1024, 256), dtype=np.float32)  # 9.4 MB
    big = Conditioning("s", 0, tokens, np.arange(8, dtype=np.int16), True)

    async def main():
        transport = Transport(config)
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "a->b", 2) as rx:
            async with Sender(transport, rx.endpoint, "a->b", "a", capacity=2) as tx:
                # small: inline; larger than a slot: inline; then the 2-slot ring wraps twice
                messages = [big, cond(1, 8), cond(2, 13 * MB // 4), *(cond(i, MB // 4) for i in range(3, 8))]
                got = []
                with anyio.fail_after(20):
                    for msg in messages:
                        await tx.send(msg)
                        got.append(await rx.recv())
                kept = got[3:]  # held by us while later messages reuse their slots
                assert mapped_blocks() == 2 and tx.stats.slotted == rx.stats.slotted == 6  # theirs and ours
            with anyio.fail_after(5):
                while mapped_blocks():  # the sender unmapped on close, the receiver on its BYE
                    await anyio.sleep(0.005)
        transport.close()
        first = got[0]
        assert first.audio_tokens.dtype == np.float32 and first.audio_tokens.shape == tokens.shape
        assert np.array_equal(first.audio_tokens, tokens) and np.array_equal(first.audio, big.audio)
        assert first.audio_tokens.flags.writeable  # copied out of the slot: the consumer's own memory
        assert first.speaking and first.chunk == 0
        assert np.array_equal(got[1].audio_tokens, np.full(8, 1, np.float32))
        assert got[2].audio_tokens.shape == (13 * MB // 4,) and (got[2].audio_tokens == 2).all()
        for i, msg in enumerate(kept, 3):
            assert msg.chunk == i and (msg.audio_tokens == i).all()  # not overwritten by later messages
        assert rx.stats.bad == 0

    anyio.run(main)


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_receive_buffers_are_reused_only_once_nothing_refers_to_them():
    pool = ReceiveBuffers(2)
    a = pool.take(4096)
    view = np.frombuffer(memoryview(a[64:128]), np.float32).reshape(4, 4)  # as the codec builds arrays
    b = pool.take(4096)
    assert address(b) != address(a)  # a is held through a view of a view
    del a, b
    c = pool.take(4096)  # b was referred to by nothing but the pool
    assert pool.reused == 1 and pool.fresh == 2
    held = [c, pool.take(4096)]  # every pooled buffer held: a fresh one, the pool does not grow
    assert pool.fresh == 3 and len(pool) == 2
    view[:] = 7  # the consumer's memory stays its own: nothing handed out shares it
    assert not any(np.shares_memory(view, h) for h in held[1:])
    del held, c, view
    assert pool.take(8192).nbytes == 8192 and pool.fresh == 4 and len(pool) == 2  # a free one gave its place
    assert pool.take(8192).nbytes == 8192 and pool.reused == 2 and pool.fresh == 4


def test_a_received_buffer_is_reused_after_the_consumer_drops_it_and_never_while_held(tmp_path):
    """The receiver copies each slot into a pooled buffer: reused once the consumer let go (no fresh
    pages to fault in), never while any array of the message is held, and the pool stays bounded."""
    capacity, floats = 2, MB // 4

    async def main():
        transport = Transport(TransportConfig())
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "a->b", capacity) as rx:
            async with Sender(transport, rx.endpoint, "a->b", "a", capacity=capacity) as tx:
                seen = set()
                with anyio.fail_after(20):
                    for i in range(6):  # taken and dropped: the pool's buffers come round again
                        await tx.send(cond(i, floats))
                        msg = await rx.recv()
                        assert msg.chunk == i and (msg.audio_tokens == i).all()
                        assert msg.audio_tokens.flags.writeable and msg.audio_tokens.flags.aligned
                        seen.add(address(msg.audio_tokens))
                        del msg
                    pool = rx._blocks[b"a"].buffers
                    assert pool.reused >= 4 and len(seen) <= 2
                    held = []
                    for i in range(6, 6 + 3 * (capacity + 2)):  # held: each must stay intact
                        await tx.send(cond(i, floats))
                        msg = await rx.recv()
                        held.append(torch_like(msg.audio_tokens) if i % 2 else msg.audio_tokens[1:])
                        del msg
                    assert len(pool) == capacity + 2
            await anyio.sleep(0)
        transport.close()
        for i, kept in enumerate(held, 6):
            assert (kept == i).all()  # none overwritten while held, through a view or a derived array
        assert len({address(k) for k in held}) == len(held)

    anyio.run(main)


def torch_like(array: np.ndarray) -> np.ndarray:
    """What a consumer that wraps an array without copying keeps: a reshaped view of a view."""
    return array.reshape(-1, 1)[:, 0]


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
            ("more arrays than a message has", [slot + struct.pack("<Q", 1) * 65, header], "slot reference of 524 bytes"),
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


def truncate_from_another_process(pid: int, fd: int) -> list[str]:
    """What ftruncate (to 0, then to 1 GiB) of ``pid``'s ``fd`` gives another process that opened it read-write."""
    code = ("import errno, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "for size in (0, 1 << 30):\n"
            "    try:\n"
            "        os.ftruncate(fd, size)\n"
            "        print('truncated')\n"
            "    except OSError as e:\n"
            "        print(errno.errorcode[e.errno])\n")
    done = subprocess.run([sys.executable, "-c", code, f"/proc/{pid}/fd/{fd}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_kernel_refuses_to_truncate_a_mapped_block(tmp_path):
    """A receiver that mapped an unsealed block died of SIGBUS when the block was truncated under it."""

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
            with anyio.fail_after(5):
                assert (await rogue.recv_multipart())[0] == CREDIT and b"rogue" in rx._blocks  # mapped
            for size in (0, 64 * 1024, 1 << 30):  # shrink it under the mapping, or grow it
                with pytest.raises(PermissionError):
                    os.ftruncate(block.fd, size)
            with pytest.raises(PermissionError):  # nor can the seals change (SEAL is sealed)
                fcntl.fcntl(block.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert truncate_from_another_process(os.getpid(), block.fd) == ["EPERM", "EPERM"]
            assert os.fstat(block.fd).st_size == 2 * 64 * 1024
            await rogue.send_multipart([SLOT, ref, bytes(header)])
            with anyio.fail_after(5):
                msg = await rx.recv()
            assert msg.chunk == 0 and (msg.audio_tokens == 0).all() and rx.stats.bad == 0
            rogue.close(0)
        block.close()
        transport.close()

    anyio.run(main)


def memfd(size: int, seals: int = 0) -> int:
    fd = os.memfd_create("not-ours", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_bad_hello_geometry_or_block_is_refused_naming_the_peer(tmp_path):
    config = TransportConfig(max_message_bytes=MB)

    async def main():
        transport = Transport(config)
        small = SlotBlock(1, 4096)
        geometry = msgpack.unpackb(small.geometry())
        closed = 999  # fds are allocated lowest first: nothing here opens this one
        with pytest.raises(OSError):
            os.fstat(closed)
        pipe_r, pipe_w = os.pipe()
        regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
        os.ftruncate(regular, 4096)
        unsealed, shrink_only = memfd(4096), memfd(4096, fcntl.F_SEAL_SHRINK)
        no_seal_seal = memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        larger = memfd(8192, SEALS)
        cases = [
            ("garbage", os.urandom(16), "not"),
            ("extra key", msgpack.packb({**geometry, "x": 1}), "keys fd, slots, slot_bytes"),
            ("negative fd", msgpack.packb({**geometry, "fd": -1}), "bad fd -1"),
            ("missing fd", msgpack.packb({**geometry, "fd": closed}), f"cannot open fd {closed} of process {os.getpid()}"),
            ("a pipe", msgpack.packb({**geometry, "fd": pipe_r}), "is not a memfd"),
            ("a regular file", msgpack.packb({**geometry, "fd": regular}), "not a memfd (it cannot be sealed)"),
            ("no seals", msgpack.packb({**geometry, "fd": unsealed}), "not sealed against shrink, grow and reseal (seals 0x0)"),
            ("shrink sealed only", msgpack.packb({**geometry, "fd": shrink_only}), "not sealed"),
            ("seals not sealed", msgpack.packb({**geometry, "fd": no_seal_seal}), "not sealed"),
            ("zero slots", msgpack.packb({**geometry, "slots": 0}), "bad slots 0"),
            ("slot over the message limit", msgpack.packb({**geometry, "slot_bytes": 2 * MB}), "bad slot_bytes"),
            ("block smaller than its geometry", msgpack.packb({**geometry, "slots": 4}), "holds 4096 bytes"),
            ("block larger than its geometry", msgpack.packb({**geometry, "fd": larger}), "holds 8192 bytes"),
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
                error = rx.stats.last_error
                assert "peer 'rogue': hello refused" in error and expected in error, (name, error)
            assert b"rogue" not in rx._credit_out and not rx._blocks  # never registered, never granted
            assert await rogue.poll(100) == 0 and mapped_blocks() == 1  # only the rogue's own
            async with Sender(transport, rx.endpoint, "a->rx", "a") as tx:  # the channel still works
                await tx.send(cond(0, MB // 8))
                with anyio.fail_after(5):
                    assert (await rx.recv()).chunk == 0
            assert rx.stats.slotted == 1
            rogue.close(0)
        small.close()
        for fd in (pipe_r, pipe_w, regular, unsealed, shrink_only, no_seal_seal, larger):
            os.close(fd)
        transport.close()

    anyio.run(main)


def test_a_peer_can_only_point_at_its_own_descriptors(tmp_path):
    """The pid comes from the connection: another process's HELLO naming our block's fd is refused."""
    fd = 900  # a sealed block of ours, under a number the peer has not opened

    async def main():
        transport = Transport(TransportConfig())
        block = SlotBlock(1, 4096)
        os.dup2(block.fd, fd)
        geometry = msgpack.packb({**msgpack.unpackb(block.geometry()), "fd": fd})
        async with Receiver(transport, f"ipc://{tmp_path}/e.sock", "other->rx", 4) as rx:
            with spawned(hello_sender, rx.endpoint, geometry) as peer:
                with anyio.fail_after(30):
                    while rx.stats.bad < 1:
                        await anyio.sleep(0.01)
                assert f"peer 'other': hello refused: cannot open fd {fd} of process {peer.pid}" in rx.stats.last_error
                assert not rx._blocks
        os.close(fd)
        block.close()
        transport.close()

    anyio.run(main)


def test_a_slot_hello_over_tcp_is_refused(tmp_path):
    async def main():
        transport = Transport(TransportConfig())
        block = SlotBlock(1, 4096)
        async with Receiver(transport, "tcp://127.0.0.1:*", "rogue->rx", 4) as rx:
            rogue = transport.ctx.socket(zmq.DEALER)
            rogue.routing_id = b"rogue"
            rogue.connect(rx.endpoint)
            await rogue.send_multipart([HELLO, block.geometry()])
            with anyio.fail_after(5):
                while rx.stats.bad < 1:
                    await anyio.sleep(0.005)
            assert "peer 'rogue': hello refused: the sender's process is unknown" in rx.stats.last_error
            rogue.close(0)
        block.close()
        transport.close()

    anyio.run(main)


def test_a_sender_killed_with_sigkill_leaves_no_block_behind(tmp_path):
    config = TransportConfig(heartbeat_s=0.1, dead_after_s=0.8)
    ep = f"ipc://{tmp_path}/kill.sock"

    async def main():
        transport = Transport(config)
        async with Receiver(transport, ep, "slotted->rx", 2) as rx:
            with spawned(slot_sender, ep, config, MB) as peer:
                with anyio.fail_after(30):
                    msg = await rx.recv()
                assert (msg.audio_tokens == 1).all() and rx.stats.slotted == 1
                assert rx._blocks[b"slotted"].pid == peer.pid and mapped_blocks() == 1 == mapped_blocks(peer.pid)
                os.kill(peer.pid, signal.SIGKILL)
                with pytest.raises(PeerDeadError, match="'slotted'"), anyio.fail_after(10):
                    await rx.recv()
                assert mapped_blocks() == 0  # ours was the last reference: the block's memory is freed
        transport.close()

    anyio.run(main)


def test_a_receiver_closing_first_unmaps_and_the_sender_closes_cleanly(tmp_path):
    async def main():
        transport = Transport(TransportConfig())
        rx = Receiver(transport, f"ipc://{tmp_path}/e.sock", "a->b", 2)
        async with Sender(transport, rx.endpoint, "a->b", "a") as tx:
            async with rx:
                await tx.send(cond(0, MB // 4))
                with anyio.fail_after(5):
                    assert (await rx.recv()).chunk == 0
                assert mapped_blocks() == 2
            assert mapped_blocks() == 1  # the receiver unmapped on close: only the sender's is left
        assert mapped_blocks() == 0
        transport.close()

    anyio.run(main)
