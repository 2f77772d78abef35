"""``charstream bench transport``: latency, throughput and backpressure of the credit channels.

Per transport (inproc: both ends in this process; ipc/tcp: the consumer in a spawned process):

* **raw_zmq** — the same payload over a bare PAIR socket pair (send + recv in one thread, one io
  thread): a floor, but not like for like for ipc/tcp, where the channel crosses two processes.
* **raw_zmq_xproc** (ipc/tcp) — the like-for-like floor: bare PAIR sockets, the receiver in a
  spawned process (blocking recv, no asyncio, codec or credits), one message at a time (the
  receiver acks each, as capacity 1 does); one-way time on the shared monotonic clock. The payload
  itself goes through the socket (copied into the kernel and out into the receiver's message).
  ``p50_vs_raw_zmq_xproc`` is the channel's p50 over this one's, in the same run.
* **latency** — capacity 1, so each message is sent only after the previous one was taken: the
  one-way time from just before ``send`` (encode included) to ``recv`` returning (decode included),
  on the shared monotonic clock; p50/p99 over the messages after a warm-up. On ipc the arrays of a
  message from 64 kB to a slot cross in a shared-memory slot (``slotted`` counts them): copied
  into the slot, and out of the receiver's mapping into memory the consumer owns (a pooled receive
  buffer the consumer has let go of). ``receiver_faults_per_message``: the consuming process's page
  faults per message after the warm-up (fresh memory faults in once per page).
* **throughput** — capacity ``--capacity``, the producer sends as fast as credits allow;
  msgs/s = messages / (last arrival - first send).
* **backpressure** — the consumer takes a video chunk every 10 ms, the producer tries every 1 ms
  (1/10 its speed). ``max_in_flight`` is counted from the two sides' timestamps (sends started by
  t minus messages taken by t), independently of the credit accounting; producer RSS growth is the
  peak minus the start.

Two message sizes: a ``Conditioning`` of the ``characters-57b`` preset (9 × 1024 float32 tokens +
8,000 samples ≈ 53 kB) and a ``VideoChunk``: by default the characters' 704×1088, 4 frames (≈ 9.2 MB);
``--video 28x512x512`` is a FlashHead Pro chunk (22 MB). ``--slot-bytes`` sets the ipc slot size.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import functools
import multiprocessing
import platform
import resource
import struct
import tempfile
import time
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any

import anyio
import numpy as np
import psutil
import zmq

from charstream.pipeline import arguments
from charstream.pipeline.bench.output import commit_id, emit_report, percentiles
from charstream.timeline import CHARACTERS
from charstream.transport.channel import Receiver, Sender, Transport, free_tcp_port
from charstream.transport.codec import encode
from charstream.transport.config import TransportConfig
from charstream.transport.messages import Conditioning, TraceContext, VideoChunk

STAMP = "bench_sent"
WARMUP = 5


def conditioning(i: int) -> Conditioning:
    tokens = np.random.default_rng(i).random((9, 1024), dtype=np.float32)
    return Conditioning("bench", i, tokens, np.zeros(CHARACTERS.samples_per_chunk, np.int16), True)


VIDEO = (4, 704, 1088)  # the characters' chunk: frames, height, width


class Videos:
    """``VideoChunk`` messages of one shape (frames, height, width)."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        self.frames = np.random.default_rng(0).integers(0, 255, (*shape, 3), dtype=np.uint8)

    def chunk(self, i: int) -> VideoChunk:
        return VideoChunk("bench", i, self.frames, np.zeros(CHARACTERS.samples_per_chunk, np.int16), True)

    def fresh(self, i: int) -> VideoChunk:
        """A chunk in newly allocated memory (one touched byte per page), like a decoder's output: if
        messages queued up anywhere, the producer's RSS would grow by a chunk per queued message."""
        frames = np.empty_like(self.frames)
        frames.reshape(-1)[::4096] = i % 256
        return VideoChunk("bench", i, frames, np.zeros(CHARACTERS.samples_per_chunk, np.int16), True)


MESSAGES = ("conditioning", "video_chunk")


async def _consume(transport: Transport, endpoint: str, capacity: int, count: int, delay_s: float) -> dict:
    """Take ``count`` messages; return one-way latencies and take times (monotonic seconds)."""
    latencies, taken, faults = [], [], []
    async with Receiver(transport, endpoint, "producer->consumer", capacity) as rx:
        for _ in range(count):
            msg = await rx.recv()
            latencies.append(time.monotonic() - msg.trace.stamps[STAMP])
            taken.append(rx.last_taken_at)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            if delay_s:
                await anyio.sleep(delay_s)
    return {"latencies": latencies, "taken": taken, "slotted": rx.stats.slotted, "faults": faults}


def consume_in_process(endpoint: str, config: TransportConfig, capacity: int, count: int, delay_s: float) -> dict:
    transport = Transport(config)
    try:
        return anyio.run(_consume, transport, endpoint, capacity, count, delay_s)
    finally:
        transport.close()


async def _produce(transport: Transport, endpoint: str, make, count: int, period_s: float, sample_rss: bool) -> dict:
    me = psutil.Process()
    started, sent, rss = [], [], []
    async with Sender(transport, endpoint, "producer->consumer", "producer") as tx:
        for i in range(count):
            msg = make(i)
            await tx.ready()  # latency starts when the message could go, not while waiting for credit
            msg.trace = TraceContext(stamps={STAMP: time.monotonic()})
            started.append(msg.trace.stamps[STAMP])
            await tx.send(msg)
            sent.append(time.monotonic())
            del msg  # the channel alone decides how long the chunk lives
            if sample_rss:
                rss.append(me.memory_info().rss)
            if period_s:
                await anyio.sleep(period_s)
        max_credit = tx.stats.max_in_flight
    return {"started": started, "sent": sent, "rss": rss, "max_in_flight_credit": max_credit}


@functools.cache
def _ipc_folder() -> str:
    """This process's folder for the bench's ipc sockets, removed at exit: libzmq leaves a bound socket's
    file behind when the socket closes."""
    folder = tempfile.TemporaryDirectory(prefix="charstream-bench-")
    atexit.register(folder.cleanup)
    return folder.name


def _ipc_endpoint(name: str) -> str:
    return f"ipc://{_ipc_folder()}/{name}-{time.monotonic_ns()}.sock"


async def _phase(kind: str, pool, transport: Transport, make, count: int, capacity: int,
                 period_s: float = 0.0, delay_s: float = 0.0, sample_rss: bool = False) -> tuple[dict, dict, int]:
    """One producer/consumer run; returns (producer, consumer, producer RSS at start)."""
    if kind == "inproc":
        endpoint = f"inproc://bench-{time.monotonic_ns()}"
    elif kind == "ipc":
        endpoint = _ipc_endpoint("channel")
    else:
        endpoint = f"tcp://127.0.0.1:{free_tcp_port('127.0.0.1')}"
    rss0 = psutil.Process().memory_info().rss
    if kind == "inproc":
        results = {}

        async def consumer():
            results["c"] = await _consume(transport, endpoint, capacity, count, delay_s)

        async with anyio.create_task_group() as tg:  # inproc: both ends share one zmq context
            tg.start_soon(consumer)
            producer = await _produce(transport, endpoint, make, count, period_s, sample_rss)
        return producer, results["c"], rss0
    future = pool.submit(consume_in_process, endpoint, transport.config, capacity, count, delay_s)
    producer = await _produce(transport, endpoint, make, count, period_s, sample_rss)
    return producer, await anyio.to_thread.run_sync(future.result), rss0


def raw_zmq_latency(kind: str, nbytes: int, count: int) -> dict[str, float]:
    """Baseline without the channel: one zero-copy send + recv over a bare PAIR socket pair."""
    ctx = zmq.Context()
    endpoint = {
        "inproc": "inproc://raw",
        "ipc": _ipc_endpoint("raw"),
        "tcp": f"tcp://127.0.0.1:{free_tcp_port('127.0.0.1')}",
    }[kind]
    rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    rx.bind(endpoint)
    tx.connect(endpoint)
    payload = np.ones(nbytes, np.uint8)
    latencies = []
    for _ in range(count + WARMUP):
        start = time.monotonic()
        tx.send(payload, copy=False)
        rx.recv(copy=False)
        latencies.append((time.monotonic() - start) * 1e3)
    ctx.destroy(linger=0)
    return _percentiles(latencies[WARMUP:])


def _percentiles(latencies_ms: list[float]) -> dict[str, float]:
    return {f"{k}_ms": round(v, 3) for k, v in percentiles(latencies_ms, (50, 99)).items()}


def raw_zmq_receive(endpoint: str, count: int) -> list[float]:
    """The cross-process floor's receiver (runs in the spawned process): one-way latencies in ms."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoint)
    latencies = []
    for _ in range(count):
        stamp, _payload = sock.recv_multipart(copy=False)
        latencies.append((time.monotonic() - struct.unpack("d", stamp.bytes)[0]) * 1e3)
        sock.send(b"")  # the ack: the next message goes only after this one arrived
    ctx.destroy(linger=0)
    return latencies


def raw_zmq_cross_process_latency(kind: str, nbytes: int, count: int, pool) -> dict[str, float]:
    """Baseline across processes, like the channel's ipc/tcp runs, without asyncio, codec or credits."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(_ipc_endpoint("raw-cross") if kind == "ipc"
              else "tcp://127.0.0.1:*")
    future = pool.submit(raw_zmq_receive, sock.last_endpoint.decode(), count + WARMUP)
    payload = np.ones(nbytes, np.uint8)
    for _ in range(count + WARMUP):
        sock.send_multipart([struct.pack("d", time.monotonic()), payload], copy=False)
        sock.recv()
    ctx.destroy(linger=0)
    return _percentiles(future.result()[WARMUP:])


def _max_in_flight(sent: list[float], taken: list[float]) -> int:
    """Peak of (sends started by t) - (taken by t), from both sides' timestamps."""
    events = sorted([(t, 1) for t in sent] + [(t, -1) for t in taken], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


async def bench_transport(kind: str, counts: dict[str, int], capacity: int, backpressure_count: int,
                          videos: Videos, slot_bytes: int) -> dict:
    transport = Transport(TransportConfig(max_message_bytes=64 << 20, slot_bytes=slot_bytes))
    makers = {"conditioning": conditioning, "video_chunk": videos.chunk}
    pool = None if kind == "inproc" else concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    )
    out: dict[str, Any] = {}
    try:
        for name, make in makers.items():
            count = counts[name]
            _, consumer, _ = await _phase(kind, pool, transport, make, count + WARMUP, 1)
            latencies = np.array(consumer["latencies"][WARMUP:]) * 1e3
            faults = consumer["faults"]
            producer, consumer, _ = await _phase(kind, pool, transport, make, count, capacity)
            elapsed = consumer["taken"][-1] - producer["sent"][0]
            size = sum(memoryview(f).nbytes for f in encode(make(0)))
            out[name] = {
                "bytes": size,
                "messages": count,
                "p50_ms": round(float(np.percentile(latencies, 50)), 3),
                "p99_ms": round(float(np.percentile(latencies, 99)), 3),
                "msgs_per_s": round(count / elapsed, 1),
                "mb_per_s": round(count * size / elapsed / 1e6, 1),
                "slotted": consumer["slotted"],
                "receiver_faults_per_message": round((faults[-1] - faults[WARMUP - 1]) / count, 1),
                "raw_zmq": raw_zmq_latency(kind, size, count),
            }
            if pool is not None:
                xproc = out[name]["raw_zmq_xproc"] = raw_zmq_cross_process_latency(kind, size, count, pool)
                out[name]["p50_vs_raw_zmq_xproc"] = round(out[name]["p50_ms"] / xproc["p50_ms"], 2)
        producer, consumer, rss0 = await _phase(
            kind, pool, transport, videos.fresh, backpressure_count, capacity, period_s=0.001, delay_s=0.010, sample_rss=True
        )
        out["backpressure"] = {
            "capacity": capacity,
            "max_in_flight": _max_in_flight(producer["started"], consumer["taken"]),
            "max_in_flight_credit": producer["max_in_flight_credit"],
            "messages": backpressure_count,
            "message_mb": round(sum(memoryview(f).nbytes for f in encode(videos.chunk(0))) / 1e6, 2),
            "producer_period_ms": 1.0,
            "consumer_period_ms": 10.0,
            "producer_rss_growth_mb": round((max(producer["rss"]) - rss0) / 1e6, 1),
        }
    finally:
        if pool is not None:
            pool.shutdown()
        transport.close()
    return out


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
    try:
        versions["torch"] = version("torch")
    except Exception:  # torch is not needed by this benchmark; record it when present
        versions["torch"] = "absent"
    return versions


def table(report: dict) -> str:
    lines = [f"{'transport':<9} {'message':<13} {'MB':>6} {'p50 ms':>8} {'p99 ms':>8} {'msgs/s':>9} {'MB/s':>8} "
             f"{'slotted':>7} {'faults':>6}  raw zmq p50/p99 ms (in-thread; cross-process: channel p50 / its p50)"]
    for kind, res in report["transports"].items():
        for name in MESSAGES:
            r = res[name]
            xproc = r.get("raw_zmq_xproc")
            lines.append(f"{kind:<9} {name:<13} {r['bytes'] / 1e6:>6.2f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                         f"{r['msgs_per_s']:>9.1f} {r['mb_per_s']:>8.1f} {r['slotted']:>7} "
                         f"{r['receiver_faults_per_message']:>6}  "
                         f"{r['raw_zmq']['p50_ms']:.3f}/{r['raw_zmq']['p99_ms']:.3f}"
                         + (f"; {xproc['p50_ms']:.3f}/{xproc['p99_ms']:.3f}: {r['p50_vs_raw_zmq_xproc']:.2f}x"
                            if xproc else ""))
    lines.append("")
    first = next(iter(report["transports"].values()))["backpressure"]["message_mb"]
    lines.append(f"{'transport':<9} backpressure (consumer at 1/10 producer speed, {first:g} MB chunks)")
    for kind, res in report["transports"].items():
        b = res["backpressure"]
        lines.append(f"{kind:<9} max_in_flight {b['max_in_flight']} (credit count {b['max_in_flight_credit']}) "
                     f"<= capacity {b['capacity']}; producer RSS growth {b['producer_rss_growth_mb']} MB")
    lines.append("")
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in report["targets"].items()))
    lines.append(f"load average (1 min) {report['load_avg_1m_at_start']} at the start, "
                 f"{report['load_avg_1m_at_end']} at the end, on {report['machine']}; commit {report['commit']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    parser.add_argument("--out", default="bench-transport.json", help="also write the JSON report here")
    parser.add_argument("--transports", type=arguments.names(("inproc", "ipc", "tcp")), default="inproc,ipc,tcp")
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--small", type=int, default=1000, help="Conditioning messages per phase")
    parser.add_argument("--large", type=int, default=100, help="VideoChunk messages per phase")
    parser.add_argument("--backpressure", type=int, default=60, help="messages in the backpressure case")
    parser.add_argument("--video", type=video_shape, default=VIDEO, metavar="FRAMESxHxW",
                        help="the VideoChunk's frames, height and width (default 4x704x1088, the characters'; "
                             "28x512x512 is a FlashHead Pro chunk)")
    parser.add_argument("--slot-bytes", type=int, default=TransportConfig().slot_bytes,
                        help="ipc shared-memory slot size (default: the transport's; 0: no slots)")


def video_shape(text: str) -> tuple[int, int, int]:
    """``FRAMESxHxW`` -> (frames, height, width)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and 0 < int(p) <= 4096 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected FRAMESxHxW, each 1-4096 (e.g. 28x512x512)")
    frames, height, width = (int(p) for p in parts)
    return frames, height, width


def run(args: argparse.Namespace) -> int:
    counts = {"conditioning": args.small, "video_chunk": args.large}
    load_at_start = round(psutil.getloadavg()[0], 2)
    videos = Videos(args.video)
    transports = {}
    for kind in args.transports:
        transports[kind] = anyio.run(bench_transport, kind, counts, args.capacity, args.backpressure, videos,
                                     args.slot_bytes)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {platform.platform()}",
        "load_avg_1m_at_start": load_at_start,  # other work on the host skews latency
        "load_avg_1m_at_end": round(psutil.getloadavg()[0], 2),
        "commit": commit_id(),
        "versions": _versions(),
        "video": list(args.video),
        "slot_bytes": args.slot_bytes,
        "transports": transports,
    }
    report["targets"] = {
        "max_in_flight_le_capacity": all(t["backpressure"]["max_in_flight"] <= args.capacity for t in transports.values()),
    }
    if "ipc" in transports:
        ipc = transports["ipc"]["video_chunk"]
        report["targets"]["ipc_video_chunk_p50_le_1.2x_raw_zmq_xproc"] = ipc["p50_vs_raw_zmq_xproc"] <= 1.2
        report["targets"]["ipc_video_chunk_p99_le_5ms"] = ipc["p99_ms"] <= 5.0
    emit_report(report, table(report), args.out, args.json)
    return 0
