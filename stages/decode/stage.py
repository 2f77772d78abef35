"""Decode: ``Latents`` -> ``VideoChunk`` (4 RGB frames + the chunk's audio span), on its own device.

The VAE decoder is causal in time and keeps a temporal cache across chunks (``model.vae``). The
stage keeps the cache state *after* each of the last ``keep_states`` chunks it decoded (states are
immutable, so a snapshot is a reference, not a copy), and decodes chunk ``n`` from the state after
chunk ``n - 1``. Turn-start rollback (``Control(ROLLBACK, chunk=c, epoch=e)``) therefore only has
to forget the states after ``c``: the first chunk of the new epoch, ``c + 1``, continues from the
state of the last committed chunk, so the frames on screen stay continuous. Data of an older epoch
is dropped; data of a newer epoch than the last ROLLBACK seen (the control message was overtaken)
rolls back implicitly to its own chunk.

With a ``batcher`` (``decode.batch_sessions`` > 1, stages/decode/batcher.py) the sessions of one
process share one decoder: the stage keeps its states, epochs and chunk order as above and submits
each chunk with the state it continues from to one forward with other sessions' chunks.

On CUDA (``decode.graphed``, the default) a chunk is one replay of ``model.graphed_decoder.GraphedDecoder``
(bf16, channels-last): its history lives in static buffers, so each kept state is a copy of them
(``snapshot``) and a rollback copies the wanted one back; on CPU the eager decoder runs.

Decoding runs on the stage's own worker thread (stages/shared/worker.py; torch releases the GIL), so the
event loop keeps serving heartbeats and control while a chunk decodes; the stage runs in its own process group in the
``processes`` hosting (``pipeline/session.py``) or beside the others ``inproc``. torch itself is
imported on that thread too (in ``setup``): importing it takes seconds, and a stage process
whose channels are already open must keep answering heartbeats meanwhile.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from charstream.model.config import get_preset
from charstream.stages.base import Stage, StageContext
from charstream.stages.config import DecodeConfig, cpu_threads
from charstream.stages.shared.worker import StageWorker
from charstream.transport.messages import Control, ControlKind, Latents, Message, VideoChunk

if TYPE_CHECKING:
    from charstream.model.graphed_decoder import GraphedDecoder
    from charstream.model.vae import CausalState, Decoder
    from charstream.stages.decode.batcher import DecodeBatcher



@dataclass
class DecodeStats:
    decoded: int = 0
    stale: int = 0  # chunks of an older epoch, dropped
    bad: int = 0  # messages that were not decodable latents, dropped
    gaps: int = 0  # chunks decoded without the previous chunk's state (should stay 0)
    rollbacks: int = 0
    last_decode_s: float = 0.0


class DecodeStage(Stage):
    name = "decode"

    def __init__(self, config: DecodeConfig, preset: str, weights: str | None = "packaged", seed: int = 0,
                 keep_states: int = 16, batcher: DecodeBatcher | None = None) -> None:
        """``batcher``: the process's shared decode batcher (session_factory makes it), for this preset and weights."""
        if batcher is not None and ((batcher.preset, batcher.weights, batcher.device) != (preset, weights, config.device)
                                    or (weights is None and batcher.seed != seed)):
            raise ValueError(f"the decode batcher serves {batcher.preset} ({batcher.weights}, seed {batcher.seed}) on "
                             f"{batcher.device}, not {preset} ({weights}, seed {seed}) on {config.device}")
        self.batcher = batcher
        self._joined = False
        self.cfg = get_preset(preset)
        self.preset, self.weights, self.seed = preset, weights, seed
        self.device = config.device
        self.graphed = config.graphed and self.device.startswith("cuda")
        self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        own_stream = self.device.startswith("cuda") and batcher is None  # a batched decode is the batcher's
        self.worker = StageWorker("decode", cpu_threads(config.threads) if self.device == "cpu" else None,
                                  cuda_stream=self.device if own_stream else None)
        self.keep_states = keep_states  # more than playout can hold unplayed: a rollback target is always kept
        self.epoch = 0
        self.decoder: Decoder | GraphedDecoder | None = None
        self._states: OrderedDict[int, CausalState] = OrderedDict()  # chunk -> state after decoding it
        self.stats = DecodeStats()

    async def setup(self, ctx: StageContext) -> None:
        path = await self.worker.run(self._resolve_weights)
        if self.batcher is not None:
            await self.worker.run(self.batcher.join, self)  # the first session's join builds the decoder
            self._joined = True
        else:
            self.decoder = await self.worker.run(self._load, path)
            await self.worker.run(self._decode, self._zero_latent(), None)  # warm-up
        log = ctx.log.info if path else ctx.log.warning
        log("decode_ready", preset=self.preset, device=self.device, dtype=self.dtype, weights=path or "random",
            graphed=self.batcher.graphed if self.batcher else self.graphed,
            batched=self.batcher.max_sessions if self.batcher else 1)

    def _resolve_weights(self) -> str | None:
        from charstream.model.weights import resolve_weights  # torch: imported off the event loop

        return resolve_weights(self.preset, self.weights)

    def _load(self, path: str | None) -> Decoder | GraphedDecoder:
        from charstream.model.weights import load_decoder

        decoder = load_decoder(self.preset, path, self.device, self.dtype, self.seed)
        if not self.graphed:
            return decoder
        import torch

        from charstream.model.graphed_decoder import GraphedDecoder

        return GraphedDecoder(decoder, getattr(torch, self.dtype))

    def _zero_latent(self) -> np.ndarray:
        return np.zeros((self.cfg.latent_channels, self.cfg.latent_height, self.cfg.latent_width), np.float32)

    def _decode(self, latent: np.ndarray, state: CausalState | None) -> tuple[np.ndarray, CausalState]:
        import torch

        from charstream.model.vae import to_uint8_frames

        with torch.inference_mode():
            z = torch.tensor(latent, device=self.device, dtype=getattr(torch, self.dtype))  # copies: inputs are read-only
            if self.graphed:  # uint8 frames already, in a buffer the next chunk overwrites
                frames, state = self.decoder.decode_chunk(z, state)
            else:
                video, state = self.decoder.decode_chunk(z, state)
                frames = to_uint8_frames(video)
            return frames.cpu().numpy(), state

    def _state_before(self, chunk: int, ctx: StageContext) -> CausalState | None:
        """The decoder state after chunk ``chunk - 1``; none kept means the session (re)starts here."""
        if chunk - 1 in self._states:
            return self._states[chunk - 1]
        earlier = [c for c in self._states if c < chunk]
        if not earlier:
            return None
        self.stats.gaps += 1
        ctx.log.warning("decode_gap", chunk=chunk, continuing_from=max(earlier))
        return self._states[max(earlier)]

    def _forget_after(self, chunk: int) -> None:
        for c in [c for c in self._states if c > chunk]:
            del self._states[c]

    async def process(self, msg: Message, ctx: StageContext) -> None:
        if not isinstance(msg, Latents):
            self._bad(ctx, None, f"unexpected message {type(msg).__name__}")
            return
        expected = (self.cfg.latent_channels, self.cfg.latent_height, self.cfg.latent_width)
        if tuple(msg.latents.shape) != expected or msg.latents.dtype not in (np.float32, np.float16):
            self._bad(ctx, msg.chunk, f"latents {msg.latents.dtype}{tuple(msg.latents.shape)}, expected float32/float16{expected}")
            return
        if msg.epoch < self.epoch:
            self.stats.stale += 1
            ctx.log.debug("decode_stale", chunk=msg.chunk, epoch=msg.epoch, current=self.epoch)
            return
        if msg.epoch > self.epoch:  # its ROLLBACK has not reached us yet: the epoch starts at this chunk
            ctx.log.info("decode_epoch_ahead", chunk=msg.chunk, epoch=msg.epoch, previous=self.epoch)
            self._rollback(msg.chunk - 1, msg.epoch)
        started = time.perf_counter()
        state = self._state_before(msg.chunk, ctx)
        if self.batcher is None:
            frames, state = await self.worker.run(self._decode, msg.latents, state)
        else:
            frames, state = await self.batcher.decode(self, msg.latents, state)
        self.stats.last_decode_s = time.perf_counter() - started
        if msg.epoch < self.epoch:  # rolled back while decoding
            self.stats.stale += 1
            return
        self._states[msg.chunk] = state
        self._states.move_to_end(msg.chunk)
        while len(self._states) > self.keep_states:
            self._states.popitem(last=False)
        self.stats.decoded += 1
        if msg.trace.turn_id is not None:
            msg.trace.stamp("decode_done")
        await ctx.emit(VideoChunk(msg.session_id, msg.chunk, frames, msg.audio, msg.speaking, msg.epoch, msg.trace,
                                  msg.start_frame))

    def _rollback(self, last_committed: int, epoch: int) -> None:
        self.epoch = epoch
        self.stats.rollbacks += 1
        self._forget_after(last_committed)

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind != ControlKind.ROLLBACK or msg.epoch <= self.epoch or msg.chunk is None:
            return  # an older or already applied rollback (an epoch-ahead chunk applied it) changes nothing
        if msg.chunk >= 0 and msg.chunk not in self._states:
            ctx.log.warning("decode_rollback_state_missing", chunk=msg.chunk, kept=list(self._states))
        self._rollback(msg.chunk, msg.epoch)
        ctx.log.info("decode_rollback", last_committed=msg.chunk, epoch=msg.epoch)

    def _bad(self, ctx: StageContext, chunk: int | None, problem: str) -> None:
        self.stats.bad += 1
        ctx.log.error("decode_bad_input", chunk=chunk, problem=problem)

    async def teardown(self) -> None:
        if self._joined:
            self.batcher.leave(self)
            self._joined = False
        self._states.clear()
        self.decoder = None
        self.worker.close()
