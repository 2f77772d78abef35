"""Small stages the runner tests build by factory path (importable in spawned processes)."""

from __future__ import annotations

import os

import anyio
import numpy as np

from stages.base import Stage, StageContext
from transport.messages import Conditioning, Control, ControlKind, Message


class Source(Stage):
    """Emits ``count`` Conditioning messages (chunk = 0..count-1), ``size`` float32 values each."""

    def __init__(self, count: int, size: int = 16, period_s: float = 0.0) -> None:
        self.count, self.size, self.period_s = count, size, period_s
        self.sent = 0

    async def run(self, ctx: StageContext) -> None:
        for i in range(self.count):
            tokens = np.full(self.size, i, np.float32)
            await ctx.emit(Conditioning(ctx.session_id, i, tokens, np.zeros(8, np.int16), False))
            self.sent += 1
            if self.period_s:
                await anyio.sleep(self.period_s)


class Relay(Stage):
    async def process(self, msg: Message, ctx: StageContext) -> None:
        await ctx.emit(msg)


class Sink(Stage):
    """Records chunk indices; after ``expect`` messages sends SHUTDOWN (if ``expect`` > 0)."""

    def __init__(self, expect: int = 0, delay_s: float = 0.0) -> None:
        self.expect, self.delay_s = expect, delay_s
        self.chunks: list[int] = []
        self.controls: list[Control] = []
        self.torn_down = False

    async def process(self, msg: Message, ctx: StageContext) -> None:
        assert float(msg.audio_tokens[0]) == msg.chunk
        self.chunks.append(msg.chunk)
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if len(self.chunks) == self.expect:
            await ctx.send_control(Control(ctx.session_id, 1, ControlKind.SHUTDOWN))

    async def control(self, msg: Control, ctx: StageContext) -> None:
        self.controls.append(msg)

    async def teardown(self) -> None:
        self.torn_down = True


class FailAfter(Stage):
    def __init__(self, after: int) -> None:
        self.after, self.seen = after, 0

    async def process(self, msg: Message, ctx: StageContext) -> None:
        self.seen += 1
        if self.seen >= self.after:
            raise ValueError(f"boom after {self.seen}")


class Idle(Stage):
    """Does nothing until shut down; writes its pid to ``pid_file`` if given."""

    def __init__(self, pid_file: str | None = None) -> None:
        self.pid_file = pid_file

    async def setup(self, ctx: StageContext) -> None:
        if self.pid_file:
            with open(self.pid_file, "w") as f:
                f.write(str(os.getpid()))
