"""Credit channels and the control bus over real ZeroMQ sockets (inproc, ipc, tcp) and real processes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import signal
import time

import anyio
import msgpack
import numpy as np
import psutil
import pytest
import zmq
import zmq.asyncio
from test_transport_peers import SPAWN, idle_sender, slow_consumer, spawned

from charstream.transport.channel import (
    BEAT,
    CREDIT,
    CTRL,
    DATA,
    HELLO,
    ChannelError,
    ControlClient,
    ControlHub,
    PeerDeadError,
    Receiver,
    Sender,
    Transport,
)
from charstream.transport.codec import WIRE_VERSION, MessageError, encode
from charstream.transport.config import TransportConfig
from charstream.transport.messages import ClockPayload, Conditioning, Control, ControlKind
from charstream.transport.security import CurveKeys, curve_required, is_loopback


def endpoint(kind: str, tmp_path) -> str:
    return {"inproc": "inproc://edge", "ipc": f"ipc://{tmp_path}/edge.sock", "tcp": "tcp://127.0.0.1:*"}[kind]


def cond(i: int, size: int = 8) -> Conditioning:
    return Conditioning("s", i, np.full(size, i, np.float32), np.zeros(8, np.int16), False)


@pytest.mark.parametrize("kind", ["inproc", "ipc", "tcp"])
def test_messages_arrive_in_order(kind, tmp_path):
    count = 300

    async def main():
        transport = Transport(TransportConfig())
        rng = np.random.default_rng(1)
        async with Receiver(transport, endpoint(kind, tmp_path), "a->b", 4) as rx:
            async with Sender(transport, rx.endpoint, "a->b", "a") as tx, anyio.create_task_group() as tg:

                async def produce():
                    for i in range(count):
                        await tx.send(cond(i))

                tg.start_soon(produce)
                got = []
                for _ in range(count):
                    msg = await rx.recv()
                    assert float(msg.audio_tokens[0]) == msg.chunk
                    got.append(msg.chunk)
                    if rng.random() < 0.05:
                        await anyio.sleep(0.002)
        transport.close()
        assert got == list(range(count))
        assert tx.stats.sent == rx.stats.received == count and rx.stats.bad == 0

    anyio.run(main)


@pytest.mark.parametrize("kind", ["inproc", "ipc"])
def test_backpressure_bounds_in_flight_and_blocks_the_producer(kind, tmp_path):
    count, capacity = 40, 3

    async def main():
        transport = Transport(TransportConfig())
        consumed = 0
        worst = 0
        consumed_when_producer_done = -1
        async with Receiver(transport, endpoint(kind, tmp_path), "fast->slow", capacity) as rx:
            async with Sender(transport, rx.endpoint, "fast->slow", "fast") as tx, anyio.create_task_group() as tg:

                async def produce():
                    nonlocal worst, consumed_when_producer_done
                    for i in range(count):
                        await tx.send(cond(i))
                        worst = max(worst, (i + 1) - consumed)  # observed by counting, not by credits
                        assert tx.in_flight <= capacity
                    consumed_when_producer_done = consumed

                tg.start_soon(produce)
                for _ in range(count):
                    await rx.recv()
                    consumed += 1
                    assert rx.pending() <= capacity
                    await anyio.sleep(0.004)
        transport.close()
        assert worst <= capacity
        assert tx.stats.max_in_flight == capacity  # it filled the window...
        assert consumed_when_producer_done >= count - capacity  # ...and then had to wait for the consumer

    anyio.run(main)


def test_memory_stays_bounded_with_a_slow_consumer_process(tmp_path):
    """4 MB messages, consumer in another process much slower than the producer: RSS must not grow."""
    count, capacity, mb = 100, 2, 4
    config = TransportConfig(max_message_bytes=8 << 20)
    ep = f"ipc://{tmp_path}/slow.sock"

    async def main():
        me = psutil.Process()
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
            future = pool.submit(slow_consumer, ep, config, capacity, count, 0.01)
            transport = Transport(config)
            baseline, peak = me.memory_info().rss, 0
            async with Sender(transport, ep, "producer->consumer", "producer") as tx:
                for i in range(count):
                    msg = cond(i, size=mb * (1 << 20) // 4)
                    await tx.send(msg)
                    del msg
                    peak = max(peak, me.memory_info().rss)
                    assert tx.in_flight <= capacity
                in_order = await anyio.to_thread.run_sync(future.result)
            transport.close()
        assert in_order == count
        growth_mb = (peak - baseline) / (1 << 20)
        # Unbounded queueing would hold up to count * 4 MB = 400 MB here; the window is capacity * 4 MB.
        # The margin is for the allocator (glibc may serve freed 4 MB blocks from its heap).
        assert growth_mb < 64, f"producer RSS grew by {growth_mb:.0f} MB"

    anyio.run(main)


def _bad_cases(config: TransportConfig):
    good = [bytes(f) for f in encode(cond(0))]
    header = msgpack.unpackb(good[0])

    def variant(**changes):
        return [msgpack.packb({**header, **changes}), *good[1:]]

    spec = [list(s) for s in header["a"]]
    spec[0][2] = [999]
    big = [bytes(f) for f in encode(cond(0, size=config.max_message_bytes // 4 + 1))]
    huge_empty = [list(s) for s in header["a"]]
    huge_empty[0][2] = [0, 2**63]  # zero elements, but numpy cannot hold the dimension
    return [
        ("empty array with an impossible dimension", [variant(a=huge_empty)[0], b"", good[2]], "exceeds the limit"),
        ("version true", variant(v=True), "wire version True"),
        ("version 1.0", variant(v=1.0), "wire version 1.0"),
        ("random bytes", [os.urandom(64)], "not msgpack"),
        ("truncated multipart", good[:2], "frames follow"),
        ("wrong version", variant(v=WIRE_VERSION + 7), "wire version"),
        ("unknown type", variant(t="Exploit"), "unknown message type"),
        ("tensor size mismatch", variant(a=spec), "frame has"),
        ("over the size limit", big, "exceeds the limit"),
    ]


@pytest.mark.parametrize("kind", ["inproc", "ipc", "tcp"])
def test_bad_messages_are_counted_and_nothing_valid_is_lost(kind, tmp_path):
    config = TransportConfig(max_message_bytes=64 * 1024)
    cases = _bad_cases(config)

    async def main():
        transport = Transport(config)
        async with Receiver(transport, endpoint(kind, tmp_path), "rogue->rx", 64) as rx:
            rogue = transport.ctx.socket(zmq.DEALER)
            rogue.routing_id = b"rogue"
            rogue.connect(rx.endpoint)
            stranger = transport.ctx.socket(zmq.DEALER)
            stranger.routing_id = b"stranger"
            stranger.connect(rx.endpoint)
            await stranger.send_multipart([DATA, os.urandom(32)])  # never said hello
            await rogue.send(HELLO)
            assert (await rogue.recv_multipart())[0] in (CREDIT, BEAT)
            with anyio.fail_after(5):
                while rx.stats.bad < 1:
                    await anyio.sleep(0.005)
            assert "never said hello" in rx.stats.last_error and "'stranger'" in rx.stats.last_error
            seq = 0
            for n, (name, frames, expected) in enumerate(cases, 1):
                for payload in ([bytes(f) for f in encode(cond(seq))], frames):
                    await rogue.send_multipart([DATA, *payload])
                seq += 1
                with anyio.fail_after(5):
                    msg = await rx.recv()
                    while rx.stats.bad < n + 1:
                        await anyio.sleep(0.005)
                assert msg.chunk == seq - 1, name
                assert expected in rx.stats.last_error and "'rogue'" in rx.stats.last_error, (name, rx.stats.last_error)
                assert "'rogue->rx'" in rx.stats.last_error
            await rogue.send_multipart([DATA, *[bytes(f) for f in encode(cond(seq))]])
            with anyio.fail_after(5):
                assert (await rx.recv()).chunk == seq  # still working after all of it
            assert rx.stats.received == len(cases) + 1
            assert rx.stats.bad == len(cases) + 1  # + the stranger's
            assert rx.stats.errors == 0  # every one refused by validation, none by the pump's last resort
            rogue.close(0)
            stranger.close(0)
        transport.close()

    anyio.run(main)


def test_sender_refuses_an_oversize_message_and_keeps_working():
    async def main():
        transport = Transport(TransportConfig(max_message_bytes=4096))
        async with Receiver(transport, "inproc://limit", "a->b", 2) as rx, Sender(transport, "inproc://limit", "a->b", "a") as tx:
            with pytest.raises(MessageError, match="exceeds the limit of 4096"):
                await tx.send(cond(0, size=2048))
            await tx.send(cond(1))
            with anyio.fail_after(5):
                assert (await rx.recv()).chunk == 1
        transport.close()

    anyio.run(main)


def test_curve_policy():
    assert curve_required("tcp://10.1.2.3:5000", force=False)
    assert curve_required("tcp://0.0.0.0:5000", force=False)
    assert not curve_required("tcp://127.0.0.1:5000", force=False)
    assert not curve_required("tcp://[::1]:5000", force=False)
    assert curve_required("tcp://127.0.0.1:5000", force=True)
    assert not curve_required("ipc:///tmp/x", force=True)
    assert is_loopback("tcp://localhost:1") and not is_loopback("tcp://eth0:1")

    async def main():
        forced = Transport(TransportConfig(curve=True))  # forced on, no keys: refused
        with pytest.raises(PermissionError, match="CURVE keys are required"):
            async with Receiver(forced, "tcp://127.0.0.1:*", "a->b", 1):
                pass
        forced.close()
        public = Transport(TransportConfig())  # not loopback, no keys: refused
        with pytest.raises(PermissionError, match="not loopback"):
            async with Receiver(public, "tcp://0.0.0.0:*", "a->b", 1):
                pass
        public.close()

    anyio.run(main)


def test_curve_refuses_unauthenticated_peers():
    keys = CurveKeys.generate()
    config = TransportConfig(curve=True)

    async def main():
        server = Transport(config, keys)
        async with Receiver(server, "tcp://127.0.0.1:*", "a->b", 4) as rx:
            client = Transport(config, keys)
            plain = client.ctx.socket(zmq.DEALER)  # no CURVE at all
            impostor = client.ctx.socket(zmq.DEALER)  # CURVE, knows the server key, wrong client key
            other_public, other_secret = zmq.curve_keypair()
            impostor.curve_serverkey = keys.server_public
            impostor.curve_publickey, impostor.curve_secretkey = other_public, other_secret
            for i, sock in enumerate((plain, impostor)):
                sock.routing_id = f"intruder{i}".encode()
                sock.connect(rx.endpoint)
                # Never blocking: once the handshake is refused the socket has no peer to queue for.
                with contextlib.suppress(zmq.Again):
                    await sock.send(HELLO, zmq.NOBLOCK)
                    await sock.send_multipart([DATA, *[bytes(f) for f in encode(cond(i))]], zmq.NOBLOCK)
            async with Sender(client, rx.endpoint, "a->b", "a") as tx:  # the session's own keys
                with anyio.fail_after(5):
                    await tx.send(cond(7))
                    assert (await rx.recv()).chunk == 7
                await anyio.sleep(0.3)
            assert rx.pending() == 0 and rx.stats.received == 1 and rx.stats.bad == 0
            assert set(rx._credit_out) <= {b"a"}  # the intruders never got as far as a hello
            plain.close(0)
            impostor.close(0)
            client.close()
        server.close()

    anyio.run(main)


def stranger_keys(keys: CurveKeys) -> CurveKeys:
    """A client that knows the session's server key but holds a key pair of its own."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(keys.server_public, b"", public, secret)


def test_a_sender_whose_keys_are_refused_fails_saying_so():
    """ZeroMQ never retries a handshake the authenticator refused: the sender's send raises, naming the
    keys, instead of waiting for a credit that cannot come."""
    keys = CurveKeys.generate()
    stranger = stranger_keys(keys)

    async def main():
        server = Transport(TransportConfig(curve=True), keys)
        async with Receiver(server, "tcp://127.0.0.1:*", "a->b", 4) as rx:
            client = Transport(TransportConfig(curve=True), stranger)
            async with Sender(client, rx.endpoint, "a->b", "a") as tx:
                with anyio.fail_after(5), pytest.raises(ChannelError, match="refused this end's CURVE keys"):
                    await tx.send(cond(1))
            client.close()
            assert rx.stats.received == 0
        server.close()

    anyio.run(main)


def test_a_control_client_whose_keys_are_refused_cannot_register():
    """A stage's control client refused by the hub fails its registration instead of blocking in it."""
    keys = CurveKeys.generate()
    stranger = stranger_keys(keys)

    async def main():
        server = Transport(TransportConfig(curve=True), keys)
        async with ControlHub(server, "tcp://127.0.0.1:*", {"a"}, lambda m, s: None, print) as hub:
            client = Transport(TransportConfig(curve=True), stranger)
            async with ControlClient(client, hub.endpoint, "a") as control:
                with anyio.fail_after(5):
                    while control.error is None:  # the refusal, seen by the client's handshake watch
                        await anyio.sleep(0.01)
                    with pytest.raises(ChannelError, match="refused this end's CURVE keys"):
                        await control.register()
            client.close()
        server.close()

    anyio.run(main)


def test_a_killed_peer_process_is_detected_by_heartbeats(tmp_path):
    config = TransportConfig(heartbeat_s=0.1, dead_after_s=0.8)
    ep = f"ipc://{tmp_path}/hb.sock"

    async def main():
        transport = Transport(config)
        async with Receiver(transport, ep, "idle->rx", 2) as rx:
            with spawned(idle_sender, ep, config) as peer:
                with anyio.fail_after(30):
                    while b"idle" not in rx._credit_out:
                        await anyio.sleep(0.02)
                await anyio.sleep(2 * config.dead_after_s)
                assert rx.error is None  # alive and beating: not declared dead while merely idle
                os.kill(peer.pid, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(PeerDeadError, match="'idle'") as info, anyio.fail_after(10):
                    await rx.recv()
                assert "no heartbeat" in str(info.value)
                assert time.monotonic() - killed < 5 * config.dead_after_s
        transport.close()

    anyio.run(main)


def test_control_bus_broadcasts_to_every_other_stage_after_all_registered():
    async def main():
        transport = Transport(TransportConfig())
        seen = []
        async with ControlHub(transport, "inproc://ctl", {"a", "b", "c"}, lambda m, s: seen.append((s, m.kind)), print) as hub:
            async with (
                ControlClient(transport, "inproc://ctl", "a") as a,
                ControlClient(transport, "inproc://ctl", "b") as b,
                ControlClient(transport, "inproc://ctl", "c") as c,
            ):
                await a.register()
                await b.register()
                await anyio.sleep(0.05)
                assert not a.started.is_set() and not hub.started.is_set()  # c is not ready yet
                await c.register()
                with anyio.fail_after(5):
                    await a.started.wait()
                    await c.started.wait()
                await a.send(Control("s", 1, ControlKind.INTERRUPT))
                with anyio.fail_after(5):
                    while not (b._queue and c._queue):
                        await anyio.sleep(0.005)
                assert b.take().kind == ControlKind.INTERRUPT and c.take().kind == ControlKind.INTERRUPT
                assert a.take() is None  # not echoed to its sender
                assert seen == [("a", ControlKind.INTERRUPT)]
                await hub.broadcast(Control("s", 2, ControlKind.SHUTDOWN))
                with anyio.fail_after(5):
                    while not (a._queue and b._queue and c._queue):
                        await anyio.sleep(0.005)
        transport.close()

    anyio.run(main)


def test_a_malformed_control_is_counted_naming_its_sender_and_the_bus_goes_on():
    async def main():
        transport = Transport(TransportConfig())
        seen = []
        async with ControlHub(transport, "inproc://ctl-bad", {"a", "b"}, lambda m, s: seen.append((s, m)), print) as hub:
            async with ControlClient(transport, "inproc://ctl-bad", "a") as a, \
                    ControlClient(transport, "inproc://ctl-bad", "b") as b:
                await a.register()
                await b.register()
                with anyio.fail_after(5):
                    await a.started.wait()
                good = Control("s", 1, ControlKind.CLOCK, chunk=3, payload=ClockPayload(due_at=time.time()))
                header = msgpack.unpackb(encode(good)[0])
                header["f"]["payload"] = ["ClockPayload", {"due_at": -5.0}]  # a wall clock before 1970
                await a.sock.send_multipart([CTRL, msgpack.packb(header)])
                await a.send(good)
                with anyio.fail_after(5):
                    while not b._queue:
                        await anyio.sleep(0.005)
                assert b.take() == good and b.take() is None  # the malformed one was not broadcast
                assert hub.stats.bad == 1 and hub.stats.received == 1 and seen == [("a", good)]
                assert "'a'" in hub.stats.last_error and "due_at must be a wall clock >= 0" in hub.stats.last_error
        transport.close()

    anyio.run(main)


@pytest.mark.parametrize("error", [PeerDeadError("no heartbeat for 1.50 s", "a->b", "a"), ChannelError("misuse", "a->b"),
                                   MessageError("header is not msgpack", "a->b", "a")], ids=lambda e: type(e).__name__)
def test_channel_errors_cross_processes_whole(error):
    """A spawned consumer's PeerDeadError reaches its parent through pickle (a process pool's result):
    it must come back as itself, not as a TypeError that breaks the pool or a message wrapped twice."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert (back.problem, back.channel, back.peer) == (error.problem, error.channel, error.peer)
