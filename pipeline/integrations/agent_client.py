"""An external voice agent's side of charstream's ZeroMQ ingest protocol (docs/AGENTS.md).

``examples/external_agent.py`` runs it from the command line; an agent of your own can use it as is:

    client = ExternalAgentClient("tcp://127.0.0.1:5790")
    await client.run(["Hello!", "Ask me anything."], pause_s=0.5, wait_for_user=True, linger_s=0.2)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from charstream.stages.agents.tts import synthesize
from charstream.stages.ingest.resample import resample

FRAME_S = 0.02
PING_S = 0.5


def say(**event) -> None:
    print(json.dumps(event), flush=True)


class ExternalAgentClient:
    """One external agent connected to charstream's ZeroMQ ingest (protocol: docs/AGENTS.md):
    hello/welcome, turns of 20 ms PCM frames at real-time pace, pings while idle, interrupts
    honoured at once. ``on_event`` gets each thing that happens as a dict (default: one JSON line
    on stdout)."""

    def __init__(self, endpoint: str, rate: int = 24_000, fmt: str = "s16le", voice: str = "en+f3",
                 on_event: Callable[..., None] | None = None, session: str | None = None) -> None:
        self.session = session  # the session token to join; None: the oldest session waiting for an agent
        self.on_event = on_event or say
        self.socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.rate, self.fmt, self.voice = rate, fmt, voice
        self.interrupted: set = set()
        self.user_ended = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.last_sent = 0.0

    async def send(self, header: dict, payload: bytes | None = None) -> None:
        header["v"] = 1
        frames = [msgpack.packb(header)] + ([payload] if payload is not None else [])
        await self.socket.send_multipart(frames)
        self.last_sent = time.monotonic()

    async def receive(self) -> None:
        while True:
            [frame] = await self.socket.recv_multipart()
            message = msgpack.unpackb(frame, raw=False)
            kind = message.get("type")
            if kind == "welcome":
                self.welcomed.set()
            elif kind == "interrupt":
                self.interrupted.add(message.get("turn"))
            elif kind == "user_speech_end":
                self.user_ended.set()
            if kind != "pong":
                self.on_event(event="received", message=message)

    async def keep_alive(self) -> None:
        while True:
            await asyncio.sleep(PING_S / 2)
            if time.monotonic() - self.last_sent >= PING_S:
                await self.send({"type": "ping"})

    def pcm(self, text: str) -> np.ndarray:
        speech = synthesize(text, self.voice)
        audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, self.rate)
        if self.fmt == "s16le":
            return np.clip(np.rint(audio * 32767), -32768, 32767).astype("<i2")
        return audio.astype("<f4")

    async def speak(self, turn: int, text: str) -> None:
        pcm = self.pcm(text)
        step = int(self.rate * FRAME_S)
        await self.send({"type": "turn_start", "turn": turn})
        start, sent = time.monotonic(), 0
        for i in range(0, len(pcm), step):
            if turn in self.interrupted:
                break
            await self.send({"type": "audio", "turn": turn, "rate": self.rate, "format": self.fmt, "channels": 1},
                            pcm[i:i + step].tobytes())
            sent += len(pcm[i:i + step])
            await asyncio.sleep(max(0.0, start + (i + step) / self.rate - time.monotonic()))  # real-time pace
        reason = "interrupted" if turn in self.interrupted else "done"
        await self.send({"type": "turn_end", "turn": turn, "reason": reason})
        self.on_event(event="turn_end", turn=turn, reason=reason, seconds_sent=round(sent / self.rate, 3))

    async def run(self, lines: list[str], pause_s: float, wait_for_user: bool, linger_s: float) -> None:
        tasks = [asyncio.create_task(self.receive()), asyncio.create_task(self.keep_alive())]
        try:
            hello = {"type": "hello", "agent": "charstream.ExternalAgentClient"}
            if self.session is not None:
                hello["session"] = self.session
            await self.send(hello)
            await asyncio.wait_for(self.welcomed.wait(), 10)
            for turn, text in enumerate(lines):
                if wait_for_user:
                    self.user_ended.clear()
                    await self.user_ended.wait()
                else:
                    await asyncio.sleep(pause_s)
                await self.speak(turn, text)
            await asyncio.sleep(linger_s)
            await self.send({"type": "bye"})
        finally:
            for task in tasks:
                task.cancel()
            self.socket.close(linger=0)
