"""A procedural test card: colour bars, a moving bar and the frame counter in digits, with a tone.

Used wherever real media is needed without a model (tests, benchmarks, ``charstream serve
--source testcard``). A *flash* chunk starts with a white frame and a click at the same media
instant, so a receiver can measure its audio/video offset. ``CardSource`` is the card as a stage:
the test-card session is a graph like the model's (card → playout → egress).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import anyio
import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.timeline import CHARACTERS, TIMELINE_RATE, Timeline
from charstream.transport.messages import Control, ControlKind, TraceContext, TurnKind, VideoChunk

if TYPE_CHECKING:
    from charstream.stages.egress.mic import UserAudioQueue

_BARS = np.array([[192, 192, 192], [192, 192, 0], [0, 192, 192], [0, 192, 0],
                  [192, 0, 192], [192, 0, 0], [0, 0, 192]], np.uint8)
# 3×5 bitmaps of the digits 0-9, one row string per line.
_FONT = ["111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
         "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111"]
_DIGITS = np.array([[int(b) for b in d] for d in _FONT], bool).reshape(10, 5, 3)
TONE_HZ = 440.0
TONE_AMPLITUDE = 1500
CLICK_SAMPLES = 96  # 2 ms
CLICK_AMPLITUDE = 30000


def frame_image(number: int, height: int, width: int, flash: bool = False, speaking: bool = False) -> np.ndarray:
    """One RGB frame: colour bars, a bar moving one step per frame, ``number`` in digits; a red
    border while speaking."""
    if flash:
        return np.full((height, width, 3), 255, np.uint8)
    columns = np.arange(width) * len(_BARS) // width
    image = np.repeat(_BARS[columns][None], height, axis=0)
    if speaking:
        border = max(height // 16, 2)
        image[:border] = image[-border:] = image[:, :border] = image[:, -border:] = (230, 30, 30)
    bar = (number * 4) % width
    image[:, bar:bar + max(width // 32, 2)] = 255
    scale = max(height // 32, 1)
    text = str(number % 10_000)
    top, left = height // 2, 2 * scale
    for i, ch in enumerate(text):
        glyph = np.kron(_DIGITS[int(ch)], np.ones((scale, scale), bool))
        x = left + i * 4 * scale
        region = image[top:top + glyph.shape[0], x:x + glyph.shape[1]]
        if region.shape[:2] != glyph.shape:
            break
        region[:] = 16
        region[glyph[: region.shape[0], : region.shape[1]]] = 240
    return image


def chunk_audio(chunk: int, flash: bool = False, speaking: bool = False, timeline: Timeline = CHARACTERS) -> np.ndarray:
    """The chunk's span of a quiet continuous tone (a fifth up while speaking); a flash chunk starts
    with a click."""
    span = timeline.samples_per_chunk
    t = (chunk * span + np.arange(span)) / TIMELINE_RATE
    tone = TONE_HZ * 1.5 if speaking else TONE_HZ
    audio = (TONE_AMPLITUDE * np.sin(2 * np.pi * tone * t)).astype(np.int16)
    if flash:
        audio[:CLICK_SAMPLES] = CLICK_AMPLITUDE
    return audio


def card_chunk(session_id: str, chunk: int, height: int = 128, width: int = 128, flash: bool = False,
               speaking: bool = False, epoch: int = 0, turn_id: int | None = None,
               timeline: Timeline = CHARACTERS) -> VideoChunk:
    n = timeline.frames_per_chunk
    frames = np.stack([frame_image(chunk * n + i, height, width, flash and i == 0, speaking) for i in range(n)])
    return VideoChunk(session_id, chunk, frames, chunk_audio(chunk, flash, speaking, timeline), speaking, epoch,
                      TraceContext(turn_id=turn_id))



class CardSource(Stage):
    """The test card as the session graph's source (in place of conditioning → diffusion → decode).

    It emits chunks as fast as playout's credit lets it, a flash + click chunk every ``flash_every``.
    The user's microphone (``user_audio``) goes through silero-vad; each end of speech starts a turn
    the way the real pipeline does: ``Control(TURN_START)`` to playout, which drops the unplayed
    chunks and answers ``ROLLBACK``; the card then regenerates from ``last_committed + 1`` in the new
    epoch with "speech" (a red border and a higher tone) for ``turn_chunks`` chunks, stamping the
    turn's trace as ingest and conditioning would — an agent that answers at once.
    """

    name = "card"

    def __init__(self, height: int = 128, width: int = 128, flash_every: int = 12, turn_chunks: int = 18,
                 user_audio: UserAudioQueue | None = None, listen: bool = True,
                 timeline: Timeline = CHARACTERS) -> None:
        self.timeline = timeline  # the session's: frames and audio per chunk
        self.height, self.width, self.flash_every, self.turn_chunks = height, width, flash_every, turn_chunks
        self.user_audio = user_audio if listen else None  # not listening: the mic queue fills and drops (counted)
        self.chunk = 0
        self.epoch = 0
        self.turn_id = 0
        self.speaking_left = 0
        self.vad_events: list = []
        self.mic_frames = 0
        self.mic_peak_rms = 0.0
        self._speech_ends: deque[float] = deque(maxlen=4)  # user ends of speech not yet answered
        self._turn_stamps: dict[str, float] = {}
        self._awaiting_rollback = False

    async def run(self, ctx: StageContext) -> None:
        async with anyio.create_task_group() as tg:
            if self.user_audio is not None:
                tg.start_soon(self._listen, ctx)
            while True:
                if self._speech_ends and not self._awaiting_rollback:
                    self._awaiting_rollback = True
                    self._turn_stamps = {"user_speech_end": self._speech_ends.popleft()}
                    await ctx.send_control(Control(ctx.session_id, self.turn_id + 1, ControlKind.TURN_START))
                speaking = self.speaking_left > 0
                msg = card_chunk(ctx.session_id, self.chunk, self.height, self.width,
                                 flash=self.flash_every > 0 and self.chunk % self.flash_every == 0,
                                 speaking=speaking, epoch=self.epoch, turn_id=self.turn_id if speaking else None,
                                 timeline=self.timeline)
                if speaking and self._turn_stamps:  # the turn's first speaking chunk carries its trace
                    msg.trace.stamps.update(self._turn_stamps)
                    self._turn_stamps = {}
                await ctx.emit(msg)  # awaits playout's credit
                self.chunk += 1
                self.speaking_left = max(self.speaking_left - 1, 0)

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind == ControlKind.ROLLBACK and msg.epoch > self.epoch:
            self.epoch, self.chunk = msg.epoch, msg.chunk + 1
            if self._awaiting_rollback:  # our turn start: speak from here
                self._awaiting_rollback = False
                self.turn_id += 1
                self.speaking_left = self.turn_chunks
                self._turn_stamps["agent_first_audio"] = time.time()

    async def _listen(self, ctx: StageContext) -> None:
        from charstream.stages.egress.mic import UserAudioClosed
        from charstream.stages.ingest.vad import UserAudioVAD

        vad = await anyio.to_thread.run_sync(UserAudioVAD)  # torch + silero, off the event loop
        while True:
            try:
                frame = await self.user_audio.get()
            except UserAudioClosed:
                return
            self.mic_frames += 1
            rms = float(np.sqrt(np.mean(frame.samples.astype(np.float64) ** 2)))
            self.mic_peak_rms = max(self.mic_peak_rms, rms)
            for event in vad.feed(frame.samples, frame.received_at - len(frame.samples) / TIMELINE_RATE):
                self.vad_events.append(event)
                ctx.log.info("user_vad", kind=str(event.kind), at=event.at, probability=round(event.probability, 2))
                if event.kind == TurnKind.USER_SPEECH_END:
                    self._speech_ends.append(event.at)
