"""``charstream bench fuzz``: every socket that reads network input, fed generated malformed input.

Targets (each served by the real component in a background event loop of this process):

* **ipc** / **tcp** — a stage channel ``Receiver``. A rogue DEALER sends any frame kind (DATA,
  SLOT, HELLO with slot geometries, BEAT, BYE, garbage) built from valid encodings mutated at
  every level (``codec_frames``); on ipc it owns real shared-memory blocks, writes slots and
  sometimes tries to truncate its block under a reference (the SIGBUS path: the block's seals make
  the kernel refuse; without them the receiver, in this process, would die).
* **agent** — the external-agent socket (``ExternalAgent``, docs/AGENTS.md): its messages with
  hostile versions, types, turns, formats, rates, channel counts and payloads (odd sizes, NaN/inf
  float audio, over a second), garbage frames; the probe is a whole valid turn.
* **http** — the signaling server (``EgressServer``): raw HTTP/1.1 requests on fresh connections,
  every endpoint, hostile Host/key/length headers and bodies (deep JSON, long numbers, garbage),
  requests that stop half-way.
* **config** — the configuration: one to three numbers of any section set to a hostile value (NaN,
  ±inf, negative, zero, tiny, beyond int64, strings, booleans), through ``PipelineConfig.from_dict``
  and, every other input, through ``serve``'s command line (a JSON config file and its options). A
  refusal must be one line naming a key it was given (else an escape, as is any other exception); an
  accepted config that touches what a served session runs (the root, egress, playout, transport) is
  served, up to ``CONFIG_SESSIONS`` distinct ones: a test-card session must stream and the idle server
  stay under ``IDLE_CPU`` of a core (else wrongly accepted).

Between inputs a well-behaved peer (a real ``Sender``; for http a keyed ``POST /session`` +
``/hangup``) sends a valid message every ``--probe-every`` inputs: all of them must arrive.
Counted per target: inputs, bad (refused with a clear error), accepted (and wrongly accepted: an
accepted message whose values break the message types; for http a 2xx where the request had no
right to one), escapes (the pump's last-resort handler, an exception out of the consumer, a 5xx),
hangs (a probe or response not back within ``HANG_S``), crashes (the run itself dying is one: the
components run in this process), RSS growth and valid messages delivered / sent.

    charstream bench fuzz --inputs 100000 --targets ipc,tcp,http,agent --out bench-fuzz.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import random
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgpack
import numpy as np
import psutil
import zmq

from charstream.logs import configure_logging
from charstream.pipeline import arguments
from charstream.pipeline.bench.output import commit_id, emit_report, text_table
from charstream.pipeline.runtime.loop_lag import LAG_INTERVAL_S, RECENT_S, LoopLag, late_between
from charstream.transport.channel import BEAT, BYE, CREDIT, DATA, HELLO, SLOT, Receiver, Sender, Transport
from charstream.transport.codec import INT_MAX, INT_MIN, WIRE_VERSION, encode
from charstream.transport.config import TransportConfig
from charstream.transport.messages import (
    CONTROL_PAYLOADS,
    MESSAGE_TYPES,
    AgentAudio,
    Conditioning,
    Control,
    ControlKind,
    Latents,
    RollbackPayload,
    TraceContext,
    TurnEvent,
    TurnKind,
    VideoChunk,
)
from charstream.transport.slots import SlotBlock

HANG_S = 5.0
RSS_CHECKPOINTS = 10  # RSS samples over a run
HTTP_WORKERS = 16  # concurrent fuzz connections
MAX_MESSAGE_BYTES = 1 << 20
SLOT_BYTES = 64 * 1024
SLOTS = 4


def example_messages() -> list[Any]:
    """One valid message of each type (the seeds every mutation starts from)."""
    trace = TraceContext(7, {"user_speech_end": 1.5, "agent_first_audio": 2.25})
    audio = np.arange(800, dtype=np.int16)
    rng = np.random.default_rng(0)
    return [
        AgentAudio("s", 1, audio, start_sample=16000, trace=trace),
        TurnEvent("s", 2, TurnKind.USER_SPEECH_END, turn_id=7, at=12.5),
        Conditioning("s", 3, rng.random((9, 32), dtype=np.float32), audio, True, epoch=2, trace=trace),
        Latents("s", 4, rng.random((16, 8, 8)).astype(np.float16), audio, False),
        VideoChunk("s", 5, rng.integers(0, 255, (4, 16, 16, 3), np.uint8), audio, True),
        Control("s", 6, ControlKind.ROLLBACK, chunk=41, epoch=3,
                payload=RollbackPayload(ControlKind.TURN_START, onset_frame=2, dropped=3, kept=1, due_at=12.5)),
    ]


# --- codec frames: valid encodings mutated at every level -----------------------------------------

FIELD_NAMES = sorted({f for cls in MESSAGE_TYPES for f in cls.__dataclass_fields__} | {"junk"})
TYPE_NAMES = [c.__name__ for c in MESSAGE_TYPES] + ["Nope", 1, None]
POOL = [None, True, False, 0, 1, -1, 2**63, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "s",
        "user_speech_end", b"\x00", [], [1, 2], {}, {"a": 1.0}, {"turn_id": 3, "stamps": {"x": 1.0}},
        {"stamps": {"x": "y"}}, "interrupt", "rollback", "\udcff", "x" * 300,
        # control payloads: valid, out of range, of another kind, unknown
        ["ClockPayload", {"due_at": 1.5}], ["ClockPayload", {"due_at": -1.0}], ["ErrorPayload", {"stage": "", "error": ""}],
        ["RollbackPayload", {"reason": "turn_start", "onset_frame": 4, "dropped": 0, "kept": 0}], ["Nope", {}]]
DTYPES = ["<f4", "<i2", "|u1", ">f8", "<f2", "|b1", "|O", "<U4", "<c8", "x", 3, None]
SHAPES = [[], [0], [1], [4], [2, 2], [-1], [2**62, 2**62], [0, 2**63], [0, 2**62, 2**62], [1.5], "4", None,
          [1] * 9, [True], [2**64 - 1]]
_EXAMPLE_FRAMES = [[bytes(f) for f in encode(m)] for m in example_messages()]


def codec_frames(rng: random.Random, data: bytes) -> list[bytes]:
    """Codec frames (header + arrays) built from ``rng`` and ``data``: raw bytes, a valid encoding
    with header bytes flipped or cut, or a well-formed header with hostile values."""
    mode = rng.randrange(4)
    if mode == 0:  # raw bytes, split into frames
        cuts = sorted(rng.sample(range(len(data) + 1), k=min(rng.randint(0, 3), len(data) + 1)))
        return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    if mode == 1:  # a valid encoding with bytes of its header flipped or cut short
        frames = list(rng.choice(_EXAMPLE_FRAMES))
        head = bytearray(frames[0])
        for byte in data[:3]:
            head[rng.randrange(len(head))] = byte
        if rng.random() < 0.3:
            head = head[: rng.randrange(len(head) + 1)]
        keep = rng.randint(1, len(frames)) if rng.random() < 0.2 else len(frames)
        return [bytes(head), *frames[1:keep]]
    if mode == 2:  # valid as it is (accepted: must arrive intact)
        return list(rng.choice(_EXAMPLE_FRAMES))
    cls = rng.choice(MESSAGE_TYPES)  # a well-formed header, then a few hostile edits
    template = msgpack.unpackb(rng.choice(_EXAMPLE_FRAMES)[0]) if rng.random() < 0.5 else {
        "v": WIRE_VERSION, "t": cls.__name__, "f": {}, "a": []}
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(["v", "t", "f", "a", "f", "a"])
        if key == "v":
            template["v"] = rng.choice([WIRE_VERSION, 0, 2, "1", None, True, 1.0])
        elif key == "t":
            template["t"] = rng.choice(TYPE_NAMES)
        elif key == "f" and isinstance(template["f"], dict):
            template["f"][rng.choice(FIELD_NAMES)] = rng.choice(POOL)
        elif key == "a":
            template["a"] = [[rng.choice(FIELD_NAMES), rng.choice(DTYPES), rng.choice(SHAPES)]
                             for _ in range(rng.randint(0, 3))]
    frames = [msgpack.packb(template, unicode_errors="surrogateescape")]
    for spec in template["a"] if isinstance(template["a"], list) else []:
        try:  # often the size the spec declares, so decoding goes past the size check
            size = int(np.prod(spec[2])) * np.dtype(spec[1]).itemsize if rng.random() < 0.5 else len(data)
        except (TypeError, ValueError, OverflowError):
            size = len(data)
        frames.append(bytes(min(max(size, 0), 4096)))
    return frames


def well_typed(msg: Any) -> bool:
    """Whether an accepted message holds only what its type allows (the oracle for 'wrongly accepted')."""
    if type(msg) not in MESSAGE_TYPES:
        return False
    for name, value in vars(msg).items():
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "biuf" or value.ndim > 8:
                return False
        elif isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                return False
        elif isinstance(value, float):
            if not math.isfinite(value):
                return False
        elif isinstance(value, TraceContext):
            if not all(isinstance(k, str) and math.isfinite(v) for k, v in value.stamps.items()):
                return False
        elif name == "payload":
            if type(value) is not CONTROL_PAYLOADS[msg.kind]:
                return False
    return True


# --- the background loop that hosts the component under test -------------------------------------

class _Loop:
    """An asyncio loop in a thread: the component runs there, the fuzzer talks to it from here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-target", daemon=True)
        self._thread.start()

    def call(self, coro, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self._cancel_rest())  # connections still lingering, for instance
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    @staticmethod
    async def _cancel_rest() -> None:
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


class ChannelTarget:
    """A ``Receiver`` over ipc or tcp, a rogue DEALER that sends anything, a valid ``Sender`` probe."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._dir = tempfile.TemporaryDirectory(prefix="charstream-fuzz-")
        self.config = TransportConfig(max_message_bytes=MAX_MESSAGE_BYTES, slot_bytes=SLOT_BYTES,
                                      slot_min_bytes=1, heartbeat_s=0.25, dead_after_s=3600)
        self.counts = {"accepted": 0, "wrongly_accepted": 0, "probes_delivered": 0, "probes_sent": 0}
        self.escapes: list[str] = []
        self._probe_session = os.urandom(8).hex()
        self._loop = _Loop()
        self._ready, self._stop = threading.Event(), asyncio.Event()
        self._served = asyncio.run_coroutine_threadsafe(self._serve(), self._loop.loop)
        if not self._ready.wait(30):
            raise RuntimeError(f"fuzz target {kind} did not start: {self._served.exception(0)}")
        self._ctx = zmq.Context()
        self.rogue = self._ctx.socket(zmq.DEALER)
        self.rogue.linger = 0
        self.rogue.routing_id = b"rogue"
        self.rogue.connect(self.rx.endpoint)
        self.block: SlotBlock | None = None
        self._hello()

    async def _serve(self) -> None:
        """Both channel ends and the consumer, in one task (their task groups must exit where they entered)."""
        self.transport = Transport(self.config)
        endpoint = f"ipc://{self._dir.name}/rx.sock" if self.kind == "ipc" else "tcp://127.0.0.1:*"
        async with Receiver(self.transport, endpoint, "fuzz->rx", 8) as self.rx:
            async with Sender(self.transport, self.rx.endpoint, "probe->rx", "probe", 8) as self.tx:
                consumer = asyncio.ensure_future(self._consume())
                self._ready.set()
                await self._stop.wait()
                consumer.cancel()
        self.transport.close()

    async def _consume(self) -> None:
        try:
            while True:
                msg = await self.rx.recv()
                if getattr(msg, "session_id", None) == self._probe_session:
                    self.counts["probes_delivered"] += 1
                    continue
                self.counts["accepted"] += 1
                if not well_typed(msg):
                    self.counts["wrongly_accepted"] += 1
        except Exception as e:  # recv raised: the receiver failed (an escape)
            self.escapes.append(f"consumer: {type(e).__name__}: {e}")

    def _hello(self) -> None:
        """(Re)introduce the rogue: on ipc with a fresh block (the receiver unmaps the previous one)."""
        if self.kind == "ipc":
            if self.block is not None:
                self.block.close()
            self.block = SlotBlock(SLOTS, SLOT_BYTES)
            self.rogue.send_multipart([HELLO, self.block.geometry()])
        else:
            self.rogue.send(HELLO)

    def send(self, rng: random.Random, data: bytes) -> None:
        """One generated input from the rogue."""
        roll = rng.random()
        if roll < 0.04:
            self._hello()
        elif roll < 0.06 and self.kind == "ipc":  # hostile geometry (refused) - the rogue keeps its block
            geometry = msgpack.unpackb(self.block.geometry())
            geometry[rng.choice(["fd", "slots", "slot_bytes", "x"])] = rng.choice(POOL)
            self.rogue.send_multipart([HELLO, msgpack.packb(geometry, unicode_errors="surrogateescape")])
        elif roll < 0.08:
            self.rogue.send_multipart([rng.choice([BEAT, BYE, CREDIT, b"", b"\xff" * 9, data[:4]]),
                                       *([data] if rng.random() < 0.5 else [])])
        elif roll < 0.35 and self.kind == "ipc":
            self.rogue.send_multipart([SLOT, *self._slot_frames(rng, data)])
        else:
            self.rogue.send_multipart([DATA, *codec_frames(rng, data)])
        if roll < 0.06 and rng.random() < 0.5:  # say hello again so the next inputs count as the rogue's
            self._hello()
        while self.rogue.poll(0):  # credits and heartbeats for the rogue: read and ignore
            self.rogue.recv_multipart()

    def _slot_frames(self, rng: random.Random, data: bytes) -> list[bytes]:
        header, *arrays = rng.choice(_EXAMPLE_FRAMES)
        slot = rng.randrange(SLOTS)
        ref = self.block.write(slot, [memoryview(a) for a in arrays])
        edit = rng.randrange(6)
        if edit == 1:
            ref = rng.choice([0, SLOTS, 2**32 - 1]).to_bytes(4, "little") + ref[4:]
        elif edit == 2:
            ref = ref[:4] + b"".join(rng.choice([0, 1, SLOT_BYTES, 2**64 - 1]).to_bytes(8, "little") for _ in arrays)
        elif edit == 3:
            ref = ref[: rng.randrange(len(ref))]
        elif edit == 4:  # truncate the block under the reference: refused while the block is sealed
            try:
                os.ftruncate(self.block.fd, rng.choice([0, SLOT_BYTES // 2]))
            except PermissionError:
                pass
        elif edit == 5:
            header = codec_frames(rng, data)[0]
        return [ref, header]

    def _sync(self) -> None:
        """A probe: a valid message from the good sender, which must arrive."""
        self.counts["probes_sent"] += 1
        n = self.counts["probes_sent"]
        msg = Conditioning(self._probe_session, n, np.full(16, n, np.float32), np.zeros(8, np.int16), False)
        self._loop.call(self.tx.send(msg), timeout=HANG_S)
        deadline = time.monotonic() + HANG_S
        while self.counts["probes_delivered"] < n and time.monotonic() < deadline:
            time.sleep(0.0002)

    def probe(self) -> bool:
        self._sync()
        return self.counts["probes_delivered"] == self.counts["probes_sent"]

    def stats(self) -> dict[str, Any]:
        rx = self.rx.stats
        return {**self.counts, "bad": rx.bad, "escapes": rx.errors + len(self.escapes),
                "escape_examples": self.escapes[:3], "slotted": rx.slotted}

    def close(self) -> None:
        self._loop.loop.call_soon_threadsafe(self._stop.set)
        self._served.result(30)
        self._loop.close()
        self.rogue.close()
        self._ctx.term()
        if self.block is not None:
            self.block.close()
        self._dir.cleanup()


# --- http ------------------------------------------------------------------------------------------

KEY = "fuzz-key"
PATHS = ["/", "/session", "/offer", "/hangup", "/code", "/static/app.js", "/static/../server.py", "/%00",
         "/session?key=" + KEY, "/" + "a" * 9000, "/\udcff", "*"]
METHODS = ["GET", "POST", "POST", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "G\x00T", "CONNECT"]


BODIES = {"empty": b"", "{}": b"{}", "broken-json": b"{nope", "random": None, "deep-array": b"[" * 100_000 + b"]" * 100_000,
          "long-number": b'{"token": ' + b"9" * 200_000 + b"}", "nan": b'{"token": NaN}', "offer": None, "code": None,
          "token-list": b'{"token": []}', "not-utf8": b"\xff\xfe", "json-list": json.dumps([1] * 50).encode(),
          "deep-object": b'{"a":' * 5000 + b"1" + b"}" * 5000}


@dataclasses.dataclass
class HttpInput:
    raw: bytes
    entitled: bool  # a right to a 2xx: a keyed reservation or the page, from a good Host
    kind: str  # its class, for the report: method, path, host, key, body, declared length, cut


def http_request(rng: random.Random, data: bytes, port: int) -> HttpInput:
    """A raw request, whether it has a right to a 2xx, and its class."""
    method, path = rng.choice(METHODS), rng.choice(PATHS)
    good_host = rng.random() < 0.7
    host = f"127.0.0.1:{port}" if good_host else rng.choice(["evil.example", "evil.example:80", "", "\xe4", "x" * 9000,
                                                                "localhost.evil.example", "127.0.0.1.nip.io"])
    key = rng.choice([KEY, KEY, "", "wrong", "k\xe4y", KEY + " ", "\x00", "x" * 9000])
    body_kind = rng.choice(list(BODIES))
    body = {"random": data, "offer": json.dumps({"token": data.hex(), "sdp": "v=0", "type": "offer"}).encode(),
            "code": json.dumps({"code": data.hex()}).encode()}.get(body_kind, BODIES[body_kind])
    headers = [f"Host: {host}"] if rng.random() < 0.95 else []
    if rng.random() < 0.6:
        headers.append(f"X-Charstream-Key: {key}")
    length = rng.choice([len(body)] * 6 + [0, len(body) + 10, -1, 2**63, "x"])
    headers.append(f"Content-Length: {length}")
    chunked = rng.random() < 0.1
    if chunked:
        headers.append("Transfer-Encoding: chunked")
    headers.append("Connection: close")
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    raw = head.encode("utf-8", "surrogateescape") + body
    cut = rng.random() < 0.05
    if cut:
        raw = raw[: rng.randrange(len(raw))]  # the request stops half-way
    # The handlers of these never read the body: a complete head from a good Host is all it takes.
    keyed = "X-Charstream-Key" in head and key.strip() == KEY
    entitled = (good_host and len(raw) >= len(head) and "Transfer-Encoding" not in head
                and ((method == "POST" and path.split("?")[0] == "/session" and keyed)
                     or (method in ("GET", "HEAD") and path in ("/", "/static/app.js"))))
    declared = ("exact" if length == len(body) else "short" if length == len(body) + 10 else
                "zero" if length == 0 else str(length)[:8])
    kind = " ".join([ascii(method)[1:-1], ascii(path[:24])[1:-1], "host=" + ("good" if good_host else "bad"),
                     "key=" + ("none" if "X-Charstream-Key" not in head else "good" if keyed else "bad"),
                     f"body={body_kind}/{len(body)}", f"length={declared}", *(["chunked"] if chunked else []),
                     *([f"cut={len(raw)}<{len(head)}" if len(raw) < len(head) else f"cut={len(raw)}"] if cut else [])])
    return HttpInput(raw, entitled, kind)


STARVED_SHARE = 0.5  # a hang whose wait the loop (or thread) spent this late, in total, is starvation
STALL_S = 1.0  # one late wake-up this long is a stall


def hang_verdict(record: dict[str, Any]) -> str:
    """Who a hang was: the server's loop stalled on its own, the whole process was starved (the server's
    loop and a plain thread late alike: CPU or GIL, the fuzz client with them), or the server held a
    request its loop was free to answer (the same request held again on a retry)."""
    share = STARVED_SHARE * record["waited_s"]
    loop_max, loop_total = record["server_loop_late_s"]
    thread_max, thread_total = record["fuzz_thread_late_s"]
    loop_late = loop_max >= STALL_S or loop_total >= share
    thread_late = thread_max >= STALL_S or thread_total >= share
    if loop_late and thread_late:
        return "process starved"
    if loop_late:
        return "server loop stalled"
    if thread_late:
        return "fuzz client starved"
    if record["retry"].startswith("hang"):
        return "server holds the request"
    return "unexplained: no lag, answered on retry"


class ThreadLag:
    """How late a plain daemon thread of this process wakes from ``LAG_INTERVAL_S`` sleeps: the share of
    the CPU and the GIL any thread here (the fuzz's own client threads) gets."""

    def __init__(self) -> None:
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(RECENT_S / LAG_INTERVAL_S))
        self._stop = threading.Event()
        threading.Thread(target=self._probe, name="fuzz-thread-lag", daemon=True).start()

    def _probe(self) -> None:
        while True:
            asked = time.monotonic()
            if self._stop.wait(LAG_INTERVAL_S):
                return
            woke = time.monotonic()
            self.recent.append((woke, max(0.0, woke - asked - LAG_INTERVAL_S)))

    def late_between(self, start: float, end: float) -> tuple[float, float]:
        return late_between(list(self.recent), start, end)

    def close(self) -> None:
        self._stop.set()


class Hang(Exception):
    """No answer within ``HANG_S``: where the exchange stood."""

    def __init__(self, phase: str, received: int) -> None:
        super().__init__(phase)
        self.phase, self.received = phase, received


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: the server closes when done


class HttpTarget:
    """The signaling server; each input a raw request on a fresh connection."""

    def __init__(self) -> None:
        from charstream.pipeline.config import PipelineConfig
        from charstream.pipeline.session import session_factory
        from charstream.pipeline.web.server import EgressServer
        from charstream.stages.config import EgressConfig

        # aiohttp logs each request its parser refuses (a 400, counted here) with a traceback.
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        config = EgressConfig(port=0, idle_timeout_s=0.1, body_timeout_s=0.1, max_sessions=10_000,
                              sessions_per_client=10_000, reservations_per_client=10_000,
                              reservations_per_minute=1_000_000)
        self.server = EgressServer(config, session_factory(PipelineConfig(), testcard=True), access_key=KEY)
        self._loop = _Loop()
        self.port = int(self._loop.call(self.server.start()).rsplit(":", 1)[1])
        self.counts = {"accepted": 0, "wrongly_accepted": 0, "bad": 0, "escapes": 0, "hangs": 0,
                       "probes_delivered": 0, "probes_sent": 0}
        self.escape_examples: list[str] = []
        self.wrong_examples: list[str] = []
        self.probe_failures: list[str] = []
        self.hang_records: list[dict[str, Any]] = []  # every hang, diagnosed (``_diagnose``)
        self.loop_lag = LoopLag()  # the server's event loop: how late it ran, when
        self._loop.loop.call_soon_threadsafe(self.loop_lag.start)
        self.thread_lag = ThreadLag()  # a plain thread of this process: the process's (and client's) own starvation
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(HTTP_WORKERS)  # one per request in flight
        self.workers = concurrent.futures.ThreadPoolExecutor(HTTP_WORKERS)

    def _exchange(self, raw: bytes, sock: socket.socket | None = None) -> int | None:
        """The response status (None: closed without one); raises ``Hang`` past HANG_S, naming the phase.

        Reads the head and ``Content-Length`` bytes, then closes (not waiting for the server to)."""
        phase, response = "connect", b""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=HANG_S) as s:
                phase = "send"
                try:
                    s.sendall(raw)
                except TimeoutError:
                    raise
                except OSError:  # the server closed on us mid-request: a refusal
                    return None
                phase = "answer"
                deadline = time.monotonic() + HANG_S
                while not _complete(response):
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    try:
                        chunk = s.recv(65536)
                    except ConnectionResetError:
                        break
                    if not chunk:
                        break
                    response += chunk
        except TimeoutError:
            raise Hang(phase if phase != "answer" or not response else "rest of the answer", len(response)) from None
        if not response.startswith(b"HTTP/1.1 "):
            return None
        return int(response[9:12])

    def send(self, rng: random.Random, data: bytes) -> None:
        """Start one request on the worker pool (inputs overlap: slow ones must not serialise the run)."""
        self._slots.acquire()
        self.workers.submit(self._one, http_request(rng, data, self.port))

    def _one(self, request: HttpInput) -> None:
        started = time.monotonic()
        try:
            status = self._exchange(request.raw)
        except Hang as hang:
            status = "hang"
            record = self._diagnose(request.kind, request.raw, hang, started)
        except OSError as e:  # no connection to the server at all (refused, reset on connect): its failure
            status = 500
            request.raw = f"{type(e).__name__} on connect: ".encode() + request.raw
        finally:
            self._slots.release()
        with self._lock:
            if status == "hang":
                self.counts["hangs"] += 1
                self.hang_records.append(record)
            elif status is not None and status >= 500:
                self.counts["escapes"] += 1
                if len(self.escape_examples) < 3:
                    self.escape_examples.append(f"{status}: {request.raw[:160]!r}")
            elif status is not None and status < 300:
                self.counts["accepted"] += 1
                if not request.entitled:
                    self.counts["wrongly_accepted"] += 1
                    if len(self.wrong_examples) < 3:
                        self.wrong_examples.append(f"{status}: {request.raw[:160]!r}")
            else:
                self.counts["bad"] += 1

    def _diagnose(self, kind: str, raw: bytes, hang: Hang, started: float) -> dict[str, Any]:
        """What a hang was: its input's class, where the exchange stood, how late the server's loop and a
        plain thread of this process ran meanwhile, and whether the same request is answered when
        repeated now (a server that holds such a request hangs again; a starved one answers)."""
        ended = time.monotonic()
        loop_max, loop_total = self.loop_lag.late_between(started, ended)
        thread_max, thread_total = self.thread_lag.late_between(started, ended)
        record = {"input": kind, "phase": hang.phase, "received_bytes": hang.received,
                  "waited_s": round(ended - started, 2), "at_s": round(started - self.started, 1),
                  "load_1m": round(os.getloadavg()[0], 2),
                  "server_loop_late_s": [round(loop_max, 3), round(loop_total, 3)],  # longest, total
                  "fuzz_thread_late_s": [round(thread_max, 3), round(thread_total, 3)]}
        retried = time.monotonic()
        try:
            status = self._exchange(raw)
            record["retry"] = f"{status} in {time.monotonic() - retried:.2f} s"
        except Hang as again:
            record["retry"] = f"hang ({again.phase})"
        record["verdict"] = hang_verdict(record)
        return record

    async def _release(self) -> None:
        for session_id in list(self.server.sessions):
            await self.server.close_session(session_id, "fuzz")

    def probe(self) -> bool:
        """A valid reservation once every input so far is answered (and its reservations released)."""
        for _ in range(HTTP_WORKERS):
            self._slots.acquire()
        for _ in range(HTTP_WORKERS):
            self._slots.release()
        self._loop.call(self._release())
        self.counts["probes_sent"] += 1
        raw = (f"POST /session HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nX-Charstream-Key: {KEY}\r\n"
               "Content-Length: 2\r\nConnection: close\r\n\r\n{}").encode()
        started = time.monotonic()
        try:
            status = self._exchange(raw)
        except Hang as hang:
            status = f"no answer in {HANG_S} s"
            with self._lock:
                self.hang_records.append(self._diagnose("probe: keyed POST /session", raw, hang, started))
        ok = status == 200
        if not ok and len(self.probe_failures) < 3:
            self.probe_failures.append(f"probe {self.counts['probes_sent']}: {status}")
        self.counts["probes_delivered"] += ok
        return ok

    def stats(self) -> dict[str, Any]:
        self.workers.shutdown(wait=True)
        verdicts = collections.Counter(r["verdict"] for r in self.hang_records)
        return {**self.counts, "escape_examples": self.escape_examples, "wrong_examples": self.wrong_examples,
                "probe_failures": self.probe_failures, "hang_verdicts": dict(verdicts), "hang_records": self.hang_records,
                "server_loop_lag": self.loop_lag.summary()}

    def close(self) -> None:
        self.workers.shutdown(wait=True)
        self.thread_lag.close()
        self._loop.call(self.loop_lag.stop())
        self._loop.call(self.server.stop())
        self._loop.close()


# --- the external-agent socket ---------------------------------------------------------------------

AGENT_TYPES = ["hello", "ping", "turn_start", "audio", "audio", "audio", "turn_end", "bye", "pong", "", "welcome"]
AGENT_VALUES = [None, True, 1.0, 0, -1, 2**63, 2**64 - 1, "", "x" * 1000, "\udcff", [], {}, [1], {"a": 1}, 1.5,
                float("nan"), b"\x00"]


def agent_message(rng: random.Random, data: bytes) -> list[bytes]:
    """One message an agent could send (docs/AGENTS.md), valid or hostile at any field or frame."""
    if rng.random() < 0.1:  # not a protocol message at all
        return [data, *([data[:7]] if rng.random() < 0.3 else [])]
    kind = rng.choice(AGENT_TYPES)

    def pick(valid: list[Any], hostile: list[Any]) -> Any:  # mostly valid, so the checks behind get reached
        return rng.choice(valid) if rng.random() < 0.8 else rng.choice(hostile)

    header: dict[Any, Any] = {"v": pick([1], [True, 1.0, 2, None, "1"]), "type": kind,
                              "turn": pick([7, "t-1", None], AGENT_VALUES)}
    if kind == "audio":
        header["format"] = pick(["s16le", "f32le"], ["mulaw", [], {}, None, 3])
        header["rate"] = pick([16_000, 48_000, 96_000, 8_000], [12_345, 0, -16_000, True, 16_000.0, "16000", 2**63])
        header["channels"] = pick([1, 2], [0, 3, True, -1, 2**40, "1", [], 1.0])
    if kind == "turn_end" and rng.random() < 0.5:
        header["reason"] = pick(["done", "interrupted"], AGENT_VALUES)
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        header[rng.choice(["v", "type", "turn", "format", "rate", "channels", "reason", "agent", 1, "x"])] = \
            rng.choice(AGENT_VALUES)
    frames = [msgpack.packb(header, unicode_errors="surrogateescape")]
    if kind == "audio" or rng.random() < 0.1:
        samples = rng.choice([320, 320, 960, 16_001, 17_000, 0, 1])  # 16_001 s16 samples at 16 kHz: over 1 s
        payload = rng.choice([
            np.zeros(samples, np.int16).tobytes(), np.full(samples, np.nan, np.float32).tobytes(),
            np.full(samples, np.inf, np.float32).tobytes(), data, data[:-1] if data else b"\x01",
        ])
        frames.append(payload)
        if rng.random() < 0.05:
            frames.append(data)
    return frames


class AgentTarget:
    """The external-agent socket (``ExternalAgent``, tcp on loopback) and its event stream."""

    def __init__(self) -> None:
        from charstream.stages.config import IngestConfig
        from charstream.stages.ingest.external import ExternalAgent

        self.agent = ExternalAgent(IngestConfig(zmq_dead_after_s=3600), endpoint="tcp://127.0.0.1:0")
        self.counts = {"accepted": 0, "wrongly_accepted": 0, "bad": 0, "disconnects": 0, "hangs": 0,
                       "probes_delivered": 0, "probes_sent": 0}
        self.escapes: list[str] = []
        self.wrong_examples: list[str] = []
        self._probe_turns: set[Any] = set()
        self._loop = _Loop()
        self._loop.call(self.agent.start())
        self._consumer = asyncio.run_coroutine_threadsafe(self._consume(), self._loop.loop)
        self._ctx = zmq.Context()
        self.rogue = self._ctx.socket(zmq.DEALER)
        self.rogue.linger = 0
        self.rogue.connect(self.agent.bound_endpoint)

    async def _consume(self) -> None:
        from charstream.stages.ingest.adapters import (
            AgentAudioFrame,
            AgentDisconnected,
            AgentError,
            AgentTurnEnd,
        )

        try:
            async for event in self.agent.events():
                if isinstance(event, AgentError):
                    self.counts["bad"] += 1
                elif isinstance(event, AgentDisconnected):
                    self.counts["disconnects"] += 1
                elif isinstance(event, AgentTurnEnd) and event.turn_ref in self._probe_turns:
                    self.counts["probes_delivered"] += 1
                elif getattr(event, "turn_ref", None) not in self._probe_turns:
                    self.counts["accepted"] += 1
                    ok = event.turn_ref is None or type(event.turn_ref) in (int, str)
                    if isinstance(event, AgentAudioFrame):
                        ok = ok and event.samples.dtype.kind in "if" and bool(np.isfinite(event.samples).all()) \
                            and 1 <= event.channels <= 2 and event.samples.size / event.channels / event.sample_rate <= 1
                    if isinstance(event, AgentTurnEnd):
                        ok = ok and isinstance(event.reason, str)
                    if not ok:
                        self.counts["wrongly_accepted"] += 1
                        if len(self.wrong_examples) < 3:
                            self.wrong_examples.append(repr(event)[:200])
        except Exception as e:  # the event stream died: ingest would have lost its agent for good
            self.escapes.append(f"events: {type(e).__name__}: {e}")

    def send(self, rng: random.Random, data: bytes) -> None:
        self.rogue.send_multipart(agent_message(rng, data))
        while self.rogue.poll(0):  # welcome, error, pong: read and ignore
            self.rogue.recv_multipart()

    def probe(self) -> bool:
        """A valid turn (hello, turn_start, one 20 ms frame, turn_end) whose end must come out."""
        self.counts["probes_sent"] += 1
        turn = f"probe-{self.counts['probes_sent']}"
        self._probe_turns.add(turn)
        pack = msgpack.packb
        for frames in ([pack({"v": 1, "type": "hello", "agent": "probe"})], [pack({"v": 1, "type": "turn_start", "turn": turn})],
                       [pack({"v": 1, "type": "audio", "turn": turn, "format": "s16le", "rate": 16_000}),
                        np.zeros(320, np.int16).tobytes()],
                       [pack({"v": 1, "type": "turn_end", "turn": turn})]):
            self.rogue.send_multipart(frames)
        deadline = time.monotonic() + HANG_S
        while self.counts["probes_delivered"] < self.counts["probes_sent"] and time.monotonic() < deadline:
            while self.rogue.poll(0):
                self.rogue.recv_multipart()
            time.sleep(0.0005)
        self._probe_turns.discard(turn)
        return self.counts["probes_delivered"] == self.counts["probes_sent"]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "escapes": len(self.escapes), "escape_examples": self.escapes[:3],
                "wrong_examples": self.wrong_examples}

    def close(self) -> None:
        self._consumer.cancel()
        self._loop.call(self.agent.close())
        self._loop.close()
        self.rogue.close()
        self._ctx.term()


# --- the configuration -----------------------------------------------------------------------------

CONFIG_SESSIONS = 8  # accepted serving configs that are served (each a session of a few seconds)
IDLE_CPU = 0.2  # cores an idle server may use after its session
SERVING_SECTIONS = ("", "egress", "playout", "transport")
CONFIG_VALUES = [float("nan"), float("inf"), float("-inf"), -1, 0, 1e-9, -1e-9, 1e300, 2**63, 2**64, 2**70,
                 -(2**70), 0.5, 1, 3, True, False, None, "", "nan", "1", [], {}]


def config_keys(obj: Any = None, section: str = "") -> list[tuple[str, str]]:
    """(section, field) of every number in the pipeline config ("" for the root, "diffusion.step" nested)."""
    from charstream.pipeline.config import PipelineConfig

    obj, keys = PipelineConfig() if obj is None else obj, []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, f"{section}.{f.name}" if section else f.name)
        elif any(word in str(f.type) for word in ("int", "float")) and "bool" not in str(f.type):
            keys.append((section, f.name))
    return keys


def config_table(config: dict[str, Any], section: str) -> dict[str, Any]:
    """The table of ``config`` that holds ``section``'s keys (made on the way)."""
    for part in section.split(".") if section else []:
        config = config.setdefault(part, {})
    return config


def hostile_value(rng: random.Random) -> Any:
    if rng.random() < 0.6:
        return rng.choice(CONFIG_VALUES)
    magnitude = 10 ** rng.uniform(-12, 20)  # any scale, either sign, int or float
    value = rng.choice([1, -1]) * magnitude
    return int(value) if rng.random() < 0.5 else value


class ConfigTarget:
    """``PipelineConfig.from_dict`` and ``serve``'s option parsing, fed hostile numbers."""

    def __init__(self, sessions: int = CONFIG_SESSIONS) -> None:
        self.keys = config_keys()
        self.sessions = sessions
        self.counts = {"accepted": 0, "wrongly_accepted": 0, "bad": 0, "escapes": 0, "hangs": 0, "probes_delivered": 0,
                       "probes_sent": 0, "via_cli": 0, "served": 0}
        self.escape_examples: list[str] = []
        self.wrong_examples: list[str] = []
        self._served: set[str] = set()
        self._dir = tempfile.TemporaryDirectory(prefix="charstream-fuzz-config-")
        self._loop = _Loop()

    def send(self, rng: random.Random, data: bytes) -> None:
        picked = rng.sample(self.keys, rng.choice([1, 1, 2, 3]))
        config: dict[str, Any] = {}
        for section, name in picked:
            value = hostile_value(rng)
            value = {"edge": value} if name == "capacities" else value
            config_table(config, section)[name] = value
        given = [f"{section}.{name}" if section else name for section, name in picked]
        via_cli = rng.random() < 0.5
        self.counts["via_cli"] += via_cli
        try:
            built = self._through_cli(config) if via_cli else self._from_dict(config)
        except ValueError as e:
            text = str(e)
            if "\n" in text or not any(key in text for key in given):
                self._escape(f"unclear refusal of {config}: {text[:200]}")
            else:
                self.counts["bad"] += 1
            return
        except Exception as e:  # anything else is the config's bug
            self._escape(f"{type(e).__name__} for {config}: {e}"[:300])
            return
        self.counts["accepted"] += 1
        if any(section in SERVING_SECTIONS for section, _ in picked):
            self._serve_once(built, json.dumps(config, sort_keys=True))

    @staticmethod
    def _from_dict(config: dict[str, Any]):
        from charstream.pipeline.config import PipelineConfig

        return PipelineConfig.from_dict(config)

    def _through_cli(self, config: dict[str, Any]):
        """``serve --config FILE`` (+ ``--port``/``--batch-sessions`` when picked), parsed and built as
        ``charstream serve`` does before it starts anything; a usage error is a ValueError here."""
        import contextlib
        import io

        from charstream.pipeline import serve

        path = os.path.join(self._dir.name, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        argv = ["--config", path]
        port = config.get("egress", {}).get("port")
        if port is not None:  # the option as typed, over the file's key
            argv += ["--port", str(port)]
        parser = argparse.ArgumentParser(prog="charstream serve", exit_on_error=False)
        serve.add_arguments(parser)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit) as e:
            raise ValueError(f"egress.port: {e}") from None
        return serve.load_config(args)

    def _serve_once(self, config: Any, label: str) -> None:
        """A session on an accepted serving config (each distinct one once, up to CONFIG_SESSIONS)."""
        if label in self._served or len(self._served) >= self.sessions:
            return
        self._served.add(label)
        self.counts["served"] += 1
        try:
            problem = self._loop.call(_session_problem(config), timeout=120)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        if problem is not None:
            self.counts["wrongly_accepted"] += 1
            if len(self.wrong_examples) < 3:
                self.wrong_examples.append(f"{label}: {problem}"[:300])

    def _escape(self, text: str) -> None:
        self.counts["escapes"] += 1
        if len(self.escape_examples) < 3:
            self.escape_examples.append(text)

    def probe(self) -> bool:
        """The default config still builds (nothing an input did is kept)."""
        self.counts["probes_sent"] += 1
        ok = self._from_dict({}) == self._from_dict({"egress": {}})
        self.counts["probes_delivered"] += ok
        return ok

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "escape_examples": self.escape_examples, "wrong_examples": self.wrong_examples}

    def close(self) -> None:
        self._loop.close()
        self._dir.cleanup()


async def _session_problem(config: Any) -> str | None:
    """None when a test-card session streams on ``config`` and its server then idles; else what went wrong."""
    from charstream.pipeline.session import session_factory
    from charstream.pipeline.web.client import EgressClient
    from charstream.pipeline.web.server import EgressServer

    config.egress.port, config.egress.host = 0, "127.0.0.1"  # the fuzzed port is the option's, checked above
    server = EgressServer(config.egress, session_factory(config, testcard=True))
    url = await server.start()
    client = EgressClient()
    try:
        _, token = server.create_session()
        await client.connect(url, token)
        await client.wait_for_video(24, timeout=60)
    except Exception as e:
        return f"session: {type(e).__name__}: {e}"
    finally:
        await client.close()
    idle = await idle_cores(2.0)
    await server.stop()
    return None if idle < IDLE_CPU else f"idle server used {idle:.2f} cores"


async def idle_cores(seconds: float) -> float:
    """Cores this process uses over ``seconds`` once a session's teardown has had a second."""
    await asyncio.sleep(1.0)
    me = psutil.Process()
    before, started = sum(me.cpu_times()[:2]), time.monotonic()
    await asyncio.sleep(seconds)
    return (sum(me.cpu_times()[:2]) - before) / (time.monotonic() - started)


TARGETS: dict[str, Callable[[], Any]] = {"ipc": lambda: ChannelTarget("ipc"), "tcp": lambda: ChannelTarget("tcp"),
                                          "http": HttpTarget, "agent": AgentTarget, "config": ConfigTarget}


def fuzz(target: Any, inputs: int, seed: int, probe_every: int) -> dict[str, Any]:
    """Feed ``inputs`` generated inputs to ``target``; its counts, RSS and rate."""
    rng = random.Random(seed)
    target.probe()  # warm: allocations of the first round trip are not growth
    rss_start, blocks_start = _rss_mb(), sys.getallocatedblocks()
    started = time.monotonic()
    hangs = 0
    # RSS (after a collection) at every tenth of the run: flat after the first tenths is warm-up (first
    # imports, caches, the allocator's pools), growth with the count is a leak.
    checkpoints = {max(1, inputs * k // RSS_CHECKPOINTS) for k in range(1, RSS_CHECKPOINTS + 1)}
    rss_at: list[list[float]] = [[0, round(rss_start, 1)]]
    for i in range(inputs):
        data = rng.randbytes(rng.choice([0, 1, 8, 64, 300]))
        target.send(rng, data)
        if (i + 1) % probe_every == 0 and not target.probe():
            hangs += 1
        if i + 1 in checkpoints:
            rss_at.append([i + 1, round(_rss_mb(), 1)])
    target.probe()
    elapsed = time.monotonic() - started
    stats = target.stats()
    stats["hangs"] = stats.get("hangs", 0) + hangs
    stats.update(inputs=inputs, seed=seed, seconds=round(elapsed, 1), inputs_per_s=round(inputs / elapsed),
                 rss_start_mb=round(rss_start, 1), rss_end_mb=round(_rss_mb(), 1))
    stats["rss_growth_mb"] = round(stats["rss_end_mb"] - stats["rss_start_mb"], 1)
    stats["rss_mb_at_inputs"] = rss_at
    # MB per 1,000 inputs over the second half: ~0 when the growth is the first inputs' warm-up
    half = [point for point in rss_at if point[0] >= inputs // 2]
    stats["rss_mb_per_1000_second_half"] = round(
        1000 * (half[-1][1] - half[0][1]) / max(1, half[-1][0] - half[0][0]), 3) if len(half) > 1 else None
    # Python objects still allocated, against the start: flat means RSS growth is the allocator's, not a leak.
    stats["py_blocks_growth"] = sys.getallocatedblocks() - blocks_start
    stats["valid_lost"] = stats["probes_sent"] - stats["probes_delivered"]
    return stats


def table(report: dict[str, Any]) -> str:
    cols = ["inputs", "bad", "accepted", "wrongly_accepted", "escapes", "hangs", "valid_lost", "probes_sent",
            "rss_growth_mb", "rss_mb_per_1000_second_half", "py_blocks_growth", "inputs_per_s"]
    rows = [["target", *cols]]
    for name, r in report["targets"].items():
        rows.append([name, *(str(r[c]) for c in cols)])
    lines = [f"{name} hangs: " + ", ".join(f"{n} {verdict}" for verdict, n in r["hang_verdicts"].items())
             for name, r in report["targets"].items() if r.get("hang_verdicts")]
    return "\n".join([text_table(rows), *lines, f"crashes: {report['crashes']} (the targets run in this process)"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", type=arguments.positive_int, default=100_000, help="generated inputs per target")
    parser.add_argument("--targets", type=arguments.names(TARGETS), default="ipc,tcp,http,agent,config")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--probe-every", type=int, default=10, help="a valid message after every N inputs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    parser.add_argument("--out", default="bench-fuzz.json", help="also write the JSON report here")


def run(args: argparse.Namespace) -> int:
    configure_logging("error")  # each refusal logs a warning: 100,000 of them are not the report
    results = {}
    for name in args.targets:
        target = TARGETS[name]()
        try:
            results[name] = fuzz(target, args.inputs, args.seed, args.probe_every)
        finally:
            target.close()
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {platform.platform()}",
        "load_avg_1m_at_end": round(psutil.getloadavg()[0], 2),
        "commit": commit_id(),
        "crashes": 0,  # reaching here: no target took the process down
        "targets": results,
    }
    emit_report(report, table(report), args.out, args.json)
    clean = all(r["escapes"] == r["hangs"] == r["valid_lost"] == r["wrongly_accepted"] == 0 for r in results.values())
    return 0 if clean else 1
