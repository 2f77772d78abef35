"""Decode for ``chunk_motion`` families (SoulX-FlashHead): ``Latents`` (one chunk's latents) -> ``VideoChunk``
(its new frames + the chunk's audio span), by the session's chunk stream, which also re-encodes the chunk's
last frames as the next chunk's motion latents (``model/families/flashhead/chunks.py``). Latents of an
epoch a rollback ended, or malformed, are not decoded; the stream is told, so its next chunk starts
without them. With a ``batcher`` (``decode.batch_sessions`` > 1, ``stages/shared/chunk_batcher.py``) the chunk is
decoded in a batch with other sessions'.

A model that decodes a chunk in two parts (FlashHead Pro's ``lead_latents``) hands over its first frames
while the rest decodes: they go on at once as the chunk's first part (with all its audio), the rest as a
second part (``VideoChunk.offset``), so a turn's first speaking frame waits for a part of the decode only."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.stages.config import DecodeConfig, cpu_threads
from charstream.stages.shared.worker import StageWorker
from charstream.transport.messages import Control, ControlKind, Latents, Message, VideoChunk

if TYPE_CHECKING:
    from charstream.stages.shared.chunk_batcher import ChunkDecodeBatcher


class ChunkDecodeStage(Stage):
    name = "decode"

    def __init__(self, config: DecodeConfig, stream: Any, batcher: ChunkDecodeBatcher | None = None) -> None:
        """``batcher``: the process's shared chunk decode batcher (session_factory makes it)."""
        self.stream = stream
        self.batcher = batcher
        self.joined = False  # counted by the batcher's open sessions
        self.worker = StageWorker("decode", cpu_threads(config.threads) if config.device == "cpu" else None)
        self.epoch = 0
        self.decoded = 0
        self.bad = 0
        self.stale = 0  # latents of an older epoch, not decoded
        self.last_decode_s = 0.0

    async def setup(self, ctx: StageContext) -> None:
        if self.batcher is not None:
            self.batcher.opened()
            self.joined = True

    async def process(self, msg: Message, ctx: StageContext) -> None:
        if not isinstance(msg, Latents) or not isinstance(msg.latents, np.ndarray) or msg.latents.ndim != 4:
            self.bad += 1
            ctx.log.error("decode_bad_latents", chunk=getattr(msg, "chunk", None),
                          problem=f"expected (C, latents, h, w) latents, got {type(msg).__name__}")
            self.stream.skip()  # what it stood for will not be decoded: the next chunk may start
            return
        if msg.epoch < self.epoch:
            self.stale += 1
            self.stream.skip()
            ctx.log.debug("decode_stale", chunk=msg.chunk, epoch=msg.epoch, current=self.epoch)
            return
        self.epoch = msg.epoch
        import torch

        started = time.perf_counter()
        latents = torch.from_numpy(msg.latents)[None]
        loop = asyncio.get_running_loop()
        lead: asyncio.Future[np.ndarray] = loop.create_future()

        def handed(frames: np.ndarray) -> None:  # on the decoding thread
            loop.call_soon_threadsafe(lambda: lead.done() or lead.set_result(frames))

        if self.batcher is None:
            decoding = asyncio.ensure_future(self.worker.run(self.stream.decode, latents, handed))
        else:
            decoding = asyncio.ensure_future(self.batcher.decode(self.stream, latents, handed))
        await asyncio.wait([lead, decoding], return_when=asyncio.FIRST_COMPLETED)
        sent = 0
        if lead.done():  # the first part's frames, while the rest decodes
            msg.trace.stamp("decode_done")
            first = lead.result()
            await ctx.emit(self._chunk(msg, first, msg.audio, 0))
            sent = len(first)
        frames = await decoding
        self.last_decode_s = time.perf_counter() - started
        self.decoded += 1
        # the trace's decode_done is when the first frames were; the rest's end lets the next chunk start
        msg.trace.stamp("decode_rest_done" if sent else "decode_done")
        await ctx.emit(self._chunk(msg, frames[sent:], msg.audio[:0] if sent else msg.audio, sent))

    @staticmethod
    def _chunk(msg: Latents, frames: np.ndarray, audio: np.ndarray, offset: int) -> VideoChunk:
        return VideoChunk(msg.session_id, msg.chunk, frames, audio, msg.speaking, msg.epoch, msg.trace,
                          msg.start_frame, offset)

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind == ControlKind.ROLLBACK:
            self.epoch = max(self.epoch, msg.epoch)

    async def teardown(self) -> None:
        self.stream.close()  # releases a denoise waiting for a decode that will not come
        if self.joined:
            self.batcher.closed(self.stream)
        self.worker.close()
