"""Small stages the runner tests build by factory path (importable in spawned processes)."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import anyio
import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.transport.messages import Conditioning, Control, ControlKind, Message


class Source(Stage):
    """Emits ``count`` Conditioning messages (chunk = 0..count-1), then ``control_after`` if given."""

    def __init__(self, count: int, size: int = 16, period_s: float = 0.0, control_after: str | None = None) -> None:
        self.count, self.size, self.period_s, self.control_after = count, size, period_s, control_after
        self.sent = 0

    async def run(self, ctx: StageContext) -> None:
        for i in range(self.count):
            tokens = np.full(self.size, i, np.float32)
            await ctx.emit(Conditioning(ctx.session_id, i, tokens, np.zeros(8, np.int16), False))
            self.sent += 1
            if self.period_s:
                await anyio.sleep(self.period_s)
        if self.control_after:
            await ctx.send_control(Control(ctx.session_id, 1, ControlKind(self.control_after)))


class Relay(Stage):
    async def process(self, msg: Message, ctx: StageContext) -> None:
        await ctx.emit(msg)


class Sink(Stage):
    """Records chunk indices; after ``expect`` messages sends SHUTDOWN (if ``expect`` > 0)."""

    def __init__(self, expect: int = 0, delay_s: float = 0.0) -> None:
        self.expect, self.delay_s = expect, delay_s
        self.chunks: list[int] = []
        self.controls: list[tuple[int, ControlKind]] = []  # (data messages processed before it, kind)
        self.torn_down = False

    async def process(self, msg: Message, ctx: StageContext) -> None:
        assert float(msg.audio_tokens[0]) == msg.chunk
        self.chunks.append(msg.chunk)
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if len(self.chunks) == self.expect:
            await ctx.send_control(Control(ctx.session_id, 1, ControlKind.SHUTDOWN))

    async def control(self, msg: Control, ctx: StageContext) -> None:
        self.controls.append((len(self.chunks), msg.kind))

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
    """Does nothing until shut down; notes its pid at setup and ``teardown`` in ``note_file`` if given."""

    def __init__(self, note_file: str | None = None) -> None:
        self.note_file = note_file

    async def setup(self, ctx: StageContext) -> None:
        self._note(f"pid {os.getpid()}\n")

    async def teardown(self) -> None:
        self._note("teardown\n")

    def _note(self, text: str) -> None:
        if self.note_file:
            with open(self.note_file, "a") as f:
                f.write(text)


class NoteProcessSettings(Stage):
    """Writes its process's settings to ``note_file`` (JSON) at setup -- GIL switch interval (seconds),
    objects frozen out of the garbage collector, whether the model is imported -- then ends the session."""

    def __init__(self, note_file: str) -> None:
        self.note_file = note_file

    async def setup(self, ctx: StageContext) -> None:
        with open(self.note_file, "w") as f:
            json.dump({"switch_interval": sys.getswitchinterval(), "frozen": gc.get_freeze_count(),
                       "model_imported": "charstream.model.generator" in sys.modules}, f)

    async def run(self, ctx: StageContext) -> None:
        await ctx.send_control(Control(ctx.session_id, 1, ControlKind.SHUTDOWN))


class GateSink(Stage):
    """Blocks inside ``process`` of the first message until a control message arrives."""

    control_during_process = True

    def __init__(self) -> None:
        self.opened = anyio.Event()
        self.chunks: list[int] = []
        self.controls: list[ControlKind] = []

    async def process(self, msg: Message, ctx: StageContext) -> None:
        with anyio.fail_after(5):
            await self.opened.wait()
        self.chunks.append(msg.chunk)
        if len(self.chunks) == 2:
            await ctx.send_control(Control(ctx.session_id, 2, ControlKind.SHUTDOWN))

    async def control(self, msg: Control, ctx: StageContext) -> None:
        self.controls.append(msg.kind)
        self.opened.set()


class Hoard(Stage):
    """Holds ``objects`` small Python objects until shut down: the heap a model process has at the end
    of a long session (the interpreter's teardown collects and frees each)."""

    def __init__(self, objects: int) -> None:
        self.objects = objects

    async def setup(self, ctx: StageContext) -> None:
        # built off the event loop, so the channels' heartbeats go on meanwhile
        self.heap = await anyio.to_thread.run_sync(lambda: [[i] for i in range(self.objects)])


class Stubborn(Stage):
    """Ignores the stop: SIGTERM ignored from setup on, and its teardown holds the process ``hold_s``
    (a model process stuck in a blocking call at the session's end)."""

    def __init__(self, hold_s: float = 30.0) -> None:
        self.hold_s = hold_s

    async def setup(self, ctx: StageContext) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def teardown(self) -> None:
        time.sleep(self.hold_s)  # blocks the event loop: nothing in the process can answer
