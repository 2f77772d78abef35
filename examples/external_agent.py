"""An external voice agent driving charstream over ZeroMQ (protocol: docs/AGENTS.md).

Run charstream with ``ingest.adapter = "zmq"`` (it binds ``ingest.zmq_endpoint``), then:

    python examples/external_agent.py --endpoint tcp://127.0.0.1:5790 \
        --line "Hello! I'm speaking from another process." --line "Ask me anything."

The agent says hello, then for each line: waits (a pause, or with ``--wait-for-user`` the user's end
of speech that charstream's VAD reports), synthesises the line with espeak-ng, and streams it as
20 ms frames of PCM at real-time pace. An ``interrupt`` (the user barged in) stops the line at once.
It pings every 0.5 s while idle, so charstream knows it is alive. Each thing that happens is printed
as one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from stages.ingest.resample import resample
from stages.ingest.tts import synthesize

FRAME_S = 0.02
PING_S = 0.5


def say(**event) -> None:
    print(json.dumps(event), flush=True)


class ExampleAgent:
    def __init__(self, endpoint: str, rate: int, fmt: str, voice: str) -> None:
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
                say(event="received", message=message)

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
        say(event="turn_end", turn=turn, reason=reason, seconds_sent=round(sent / self.rate, 3))

    async def run(self, lines: list[str], pause_s: float, wait_for_user: bool, linger_s: float) -> None:
        tasks = [asyncio.create_task(self.receive()), asyncio.create_task(self.keep_alive())]
        try:
            await self.send({"type": "hello", "agent": "examples/external_agent.py"})
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5790")
    parser.add_argument("--line", action="append", help="a line to speak (repeat for several turns)")
    parser.add_argument("--rate", type=int, default=24_000, help="sample rate to send at")
    parser.add_argument("--format", default="s16le", choices=["s16le", "f32le"])
    parser.add_argument("--voice", default="en+f3")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds before each line")
    parser.add_argument("--wait-for-user", action="store_true", help="speak after each user end of speech")
    parser.add_argument("--linger", type=float, default=0.2, help="seconds to stay connected at the end")
    args = parser.parse_args(argv)
    lines = args.line or ["Hello! I am an external agent, speaking through charstream."]
    agent = ExampleAgent(args.endpoint, args.rate, args.format, args.voice)
    asyncio.run(agent.run(lines, args.pause, args.wait_for_user, args.linger))
    return 0


if __name__ == "__main__":
    sys.exit(main())
