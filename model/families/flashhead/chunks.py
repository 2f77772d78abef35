"""One session's FlashHead stream (generation mode ``chunk_motion``): chunk after chunk, each continued from
the last through motion latents.

A chunk is ``frames_per_chunk`` decoded frames (33: 9 latents for Pro's Wan VAE, 5 for Lite's LTX VAE).
Its first ``motion_latents`` latents are pinned by the sampler to the motion latents: the previous
chunk's last ``motion_frames`` (5 for Pro, 9 for Lite) decoded frames, colour-matched to the portrait
(LAB mean/std) and re-encoded by the VAE (Lite: a sample of the posterior); for the first chunk, the
portrait's first latent. So the chunk's first ``motion_frames`` frames repeat what was shown and its last
``new_frames_per_chunk`` (28 for Pro, 24 for Lite) are new. The portrait is encoded once per session:
repeated over a chunk it is the reference latent the DiT reads beside the noise.

Why one object holds both the denoising and the motion re-encode: chunk n + 1 cannot start before
chunk n is decoded, so a chunk-motion session is serial by construction and nothing is gained by
running its decode on another stage than its denoising; a feedback edge (decode -> diffusion) would
add a cycle to the stage graph (its credits, its rollback) for no overlap. The stages call
``denoise`` (diffusion) and ``decode`` (decode) on the one session object: ``denoise`` waits (on its
worker thread) until the previous chunk's ``decode`` has set the motion latents.

A turn start or barge-in drops unplayed chunks at playout and regenerates from a frame of the media
timeline: a barge-in from the end of the last chunk played, a turn start from any frame (the chunk grid
re-phased there: the speech need not wait for a chunk boundary). Each chunk is made at its first frame
on that timeline (``ready``'s ``start``): the motion latents each of the last ``KEEP_MOTION`` decoded chunks
left are kept by the frame they end at, and the frames of the last ``KEEP_FRAMES``, so a chunk that
starts where none ended takes its motion latents from the frames shown before its start, re-encoded.
Either way the regenerated chunk continues the frames on screen, not the dropped ones.

The model's work is a ``ChunkRunner``'s, over a list of streams: a stream alone runs its chunks through a
runner of its own (a batch of one, on its own CUDA stream); the batchers (``stages/shared/chunk_batcher.py``)
run several sessions' chunks through one shared runner in one batch. A stream's state and noise are its
own either way, so its frames do not depend on the batch it was in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from charstream.model.families.flashhead.colour import ColourReference, colour_reference, match_colours
from charstream.model.families.flashhead.config import FlashHeadConfig
from charstream.model.families.flashhead.dit import FlashHeadDiT
from charstream.model.families.flashhead.noise import randn_rows
from charstream.model.families.flashhead.sampler import chunk_noise, chunk_timesteps, denoise_chunk
from charstream.model.families.flashhead.vae_ltx import LtxVAE
from charstream.model.families.flashhead.vae_wan import WanVAE
from charstream.model.graphs import capture_graph, one_capture_at_a_time

KEEP_MOTION = 16  # chunks whose motion latents are kept: more than playout holds unplayed
KEEP_FRAMES = 8  # chunks whose frames are kept: a turn start places its speech within those playout holds


def to_unit(pixels: Tensor) -> Tensor:
    """uint8 pixel values -> float32 in [-1, 1], the VAE's range."""
    return pixels.float() / 127.5 - 1


def to_pixels(x: Tensor) -> Tensor:
    """Values in [-1, 1] -> uint8 pixel values."""
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


def portrait_tensor(image: np.ndarray, height: int, width: int) -> Tensor:
    """An RGB uint8 (H, W, 3) portrait -> (1, 3, 1, height, width) in [-1, 1], resized to the video size."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"a portrait is RGB uint8 (H, W, 3), got {image.dtype} {image.shape}")
    x = to_unit(torch.from_numpy(image).permute(2, 0, 1)[None])
    x = torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return x.clamp(-1, 1)[:, :, None]


class _BatchSizes:
    """A function compiled twice: for one row, as a stream alone compiles it (the same compilation), and
    for every batch size above one, its tensors' batch dimension marked dynamic (one compilation for all
    of them). ``cfg`` passes through (the sampler reads the DiT's)."""

    def __init__(self, fn: Callable, cfg: FlashHeadConfig | None = None) -> None:
        self.one, self.many, self.cfg = torch.compile(fn, dynamic=False), torch.compile(fn, dynamic=None), cfg

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for arg in args for t in ((arg.mean, arg.std) if isinstance(arg, ColourReference) else
                                               arg if isinstance(arg, tuple) else (arg,))
                   if isinstance(t, Tensor) and t.ndim]
        if tensors[0].shape[0] == 1:
            return self.one(*args, **kwargs)
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return self.many(*args, **kwargs)


class ChunkRunner:
    """The model's part of a chunk for one or more sessions' streams at once: the DiT's passes (``denoise``);
    the VAE decode, colour match and motion re-encode (``decode``). Work runs on the runner's CUDA stream,
    after what each stream has queued on its own; results are complete when a call returns.

    ``compiled``: the DiT and the VAE through ``torch.compile`` (one compilation per process and shape:
    other runners reuse it). ``batched``: batches larger than one are compiled with a dynamic batch
    dimension, so every size above one shares one compilation. ``graphed`` (CUDA): each batch size's
    denoise (per motion length) and decode is one CUDA graph, captured by ``warm``, so a batch costs a few
    replays where it cost thousands of kernel launches from Python; a batch no graph was captured for runs
    as ungraphed. Noise is drawn from the sessions' generators before a replay, so a graph serves any
    sessions. Capture while no other thread of the process runs GPU work: a device-wide synchronise
    elsewhere (cuDNN timing a new convolution shape does one) invalidates a capture in progress."""

    def __init__(self, dit: FlashHeadDiT, vae: WanVAE | LtxVAE, compiled: bool = False, batched: bool = False,
                 graphed: bool = False) -> None:
        self.cfg, self.model, self.vae, self.batched = dit.cfg, dit, vae, batched
        device = next(dit.parameters()).device
        self.dtype = next(dit.parameters()).dtype
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.graphed = graphed and self.cuda_stream is not None
        self.graphs: dict[tuple, _Graph] = {}
        self._capturing = False  # inside ``warm``: a new batch shape is captured
        # one pool for this runner's graphs: they replay one at a time, on its one thread
        self._pool = torch.cuda.graph_pool_handle() if self.graphed else None
        self._timesteps = chunk_timesteps(self.cfg).to(device)

        def compile_(fn: Callable) -> Callable:
            if not compiled:
                return fn
            return _BatchSizes(fn, getattr(fn, "cfg", None)) if batched else torch.compile(fn, dynamic=False)

        self.dit = compile_(dit)
        self._decode = compile_(vae.decode_chunk)
        if self.cfg.lead_latents:  # a VAE that decodes a chunk in parts: Pro's Wan VAE
            if not isinstance(vae, WanVAE):
                raise ValueError(f"{self.cfg.name}: lead_latents needs the Wan VAE, which decodes in parts")
            self._decode_lead, self._decode_rest = compile_(vae.decode_lead), compile_(vae.decode_rest)
        self._match = compile_(match_colours)
        self._encode = compile_(vae.encode_motion)

    @contextmanager
    def on_stream(self, waits: list[torch.cuda.Stream | None] = ()) -> Iterator[None]:
        """Work on the runner's stream, after what the calling thread's stream and ``waits`` have queued."""
        if self.cuda_stream is None:
            yield
            return
        self.cuda_stream.wait_stream(torch.cuda.current_stream(self.cuda_stream.device))
        for other in waits:
            if other is not None and other is not self.cuda_stream:
                self.cuda_stream.wait_stream(other)
        with torch.cuda.stream(self.cuda_stream):
            yield
        self.cuda_stream.synchronize()

    def _run(self, key: tuple, body: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``body(*inputs)``; graphed, a replay of ``key``'s graph with ``inputs`` copied into its static ones
        (captured now inside ``warm``). A replay's outputs are the graph's own tensors: the next replay
        rewrites them."""
        graph = self.graphs.get(key)
        if graph is None and self.graphed and self._capturing:
            graph = self._capture(key, body, inputs)
        if graph is None:
            return body(*inputs)
        for static, value in zip(graph.inputs, inputs, strict=True):
            if static is not value:  # another graph's output it reads in place
                static.copy_(value)
        graph.graph.replay()
        return graph.outputs

    @one_capture_at_a_time
    def _capture(self, key: tuple, body: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...]) -> _Graph:
        # another graph's outputs are static already (replayed before this one): read in place, not copied
        owned = {id(t) for g in self.graphs.values() for t in g.outputs}
        static = tuple(t if id(t) in owned else t.clone() for t in inputs)
        graph, outputs = capture_graph(lambda: body(*static), self.cuda_stream, pool=self._pool)
        self.graphs[key] = _Graph(graph, static, outputs)
        return self.graphs[key]

    @torch.no_grad()
    def encode(self, frames: Tensor, generators: list[torch.Generator]) -> Tensor:
        """Frames (batch, 3, 1 + stride k, H, W) -> latents in the DiT's dtype (Lite: a posterior sample per row)."""
        return self._encode(frames, *self._posterior_noise(frames.shape, generators, frames.device)).to(self.dtype)

    def _posterior_noise(self, frames_shape: tuple[int, ...], generators: list[torch.Generator],
                         device: torch.device) -> tuple[Tensor, ...]:
        """The encode's noise argument: Lite samples the LTX posterior (a draw per row from its session's
        generator), Pro takes the Wan posterior's mean (none)."""
        if self.cfg.variant != "lite":
            return ()
        return (randn_rows(self.vae.latent_shape(frames_shape), generators, torch.float32, device),)

    @torch.no_grad()
    def denoise(self, streams: list[ChunkMotionStream], tokens: list[np.ndarray | Tensor]) -> list[Tensor]:
        """Each stream's next chunk (1, C, latents, h, w) from its audio tokens (latents, tokens, d), denoised in
        batches by motion length (a first chunk continues one latent, later ones ``motion_latents``)."""
        out: list[Tensor | None] = [None] * len(streams)

        def body(reference: Tensor, audio: Tensor, motion: Tensor, noise: Tensor) -> tuple[Tensor]:
            return (denoise_chunk(self.dit, reference, audio, motion, noise, self._timesteps),)

        with self.on_stream([s.cuda_stream for s in streams]):
            device = streams[0].reference.device
            audio = [torch.as_tensor(t)[None].to(device, self.dtype) for t in tokens]
            lengths = sorted({s.motion.shape[2] for s in streams})
            for rows in (g for n in lengths for g in batch_groups([i for i, s in enumerate(streams)
                                                                  if s.motion.shape[2] == n])):
                reference = torch.cat([streams[i].reference for i in rows])
                noise = chunk_noise(self.cfg, reference.shape, [streams[i].generator for i in rows], reference.dtype, device)
                inputs = (reference, torch.cat([audio[i] for i in rows]), torch.cat([streams[i].motion for i in rows]), noise)
                (latents,) = self._run(("denoise", len(rows), inputs[2].shape[2]), body, inputs)
                latents = latents.clone()  # a replay rewrites a graph's outputs; the sessions keep these
                for row, i in enumerate(rows):
                    out[i] = latents[row:row + 1]
        return out

    @torch.no_grad()
    def decode(self, streams: list[ChunkMotionStream], latents: list[Tensor],
               leads: list[Callable[[np.ndarray], None] | None] | None = None) -> tuple[list[np.ndarray], list[Tensor]]:
        """Each stream's chunk decoded: its new frames colour-matched to its portrait, uint8 (new frames, H, W,
        3), and its next motion latents (from its last ``motion_frames`` frames, re-encoded).

        With the config's ``lead_latents`` the chunk decodes in two parts (the VAE's causal history carried
        over): the lead's new frames are matched and copied to the host first, and ``leads[i]``, where given,
        is called with stream ``i``'s (``lead_frames``, H, W, 3) while the rest decodes (on CUDA, once the lead
        is on the host; on the CPU, before the rest starts)."""
        cfg = self.cfg
        frames_out: list[np.ndarray | None] = [None] * len(streams)
        motion_out: list[Tensor | None] = [None] * len(streams)
        leads = leads or [None] * len(streams)

        def matched(new: Tensor, mean: Tensor, std: Tensor) -> Tensor:
            # what is shown is colour-matched, as the released pipeline shows it; its last frames feed the next chunk
            return self._match(new.float(), ColourReference(mean, std))

        def finish(new: Tensor, mean: Tensor, std: Tensor, noise: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
            new = matched(new, mean, std)
            motion = self._encode(new[:, :, -cfg.motion_frames:], *noise).to(self.dtype)
            return to_pixels(new.permute(0, 2, 3, 4, 1)), motion

        def whole(batch: Tensor, mean: Tensor, std: Tensor, *noise: Tensor) -> tuple[Tensor, Tensor]:
            return finish(self._decode(batch)[:, :, cfg.motion_frames:], mean, std, noise)

        def lead(batch: Tensor, mean: Tensor, std: Tensor) -> tuple[Tensor, ...]:
            frames, history = self._decode_lead(batch)
            return to_pixels(matched(frames[:, :, cfg.motion_frames:], mean, std).permute(0, 2, 3, 4, 1)), *history

        def rest(batch: Tensor, mean: Tensor, std: Tensor, *history: Tensor) -> tuple[Tensor, Tensor]:
            return finish(self._decode_rest(batch, history), mean, std, ())  # Pro: its motion encode draws no noise

        with self.on_stream([s.cuda_stream for s in streams]):
            weight = next(self.vae.parameters())
            copies, announced = [], []
            for rows in batch_groups(list(range(len(streams)))):
                batch = torch.cat([torch.as_tensor(latents[i]).to(weight.device, weight.dtype) for i in rows])
                shown = (len(rows), 3, cfg.motion_frames, cfg.height, cfg.width)  # the frames re-encoded
                colours = (torch.cat([streams[i].colours.mean for i in rows]),
                           torch.cat([streams[i].colours.std for i in rows]))
                noise = self._posterior_noise(shown, [streams[i].generator for i in rows], weight.device)
                # to page-locked memory: a pageable copy runs at a tenth of the speed and blocks the thread
                host = torch.empty((len(rows), cfg.new_frames_per_chunk, cfg.height, cfg.width, 3), dtype=torch.uint8,
                                   pin_memory=weight.is_cuda)
                # each copy is queued before any later replay rewrites what it copies
                if cfg.lead_latents:
                    head, *history = self._run(("lead", len(rows)), lead, (batch[:, :, :cfg.lead_latents], *colours))
                    host[:, :cfg.lead_frames].copy_(head, non_blocking=True)
                    if weight.is_cuda:
                        ready = torch.cuda.Event()
                        ready.record()
                        announced.append((rows, host, ready))
                    else:
                        _announce(leads, rows, host, cfg.lead_frames)
                    pixels, motion = self._run(("rest", len(rows)), rest, (batch[:, :, cfg.lead_latents:], *colours, *history))
                    host[:, cfg.lead_frames:].copy_(pixels, non_blocking=True)
                else:
                    pixels, motion = self._run(("decode", len(rows)), whole, (batch, *colours, *noise))
                    host.copy_(pixels, non_blocking=True)
                copies.append((rows, host, motion.clone()))
            for rows, host, ready in announced:  # the rest still decoding
                ready.synchronize()
                _announce(leads, rows, host, cfg.lead_frames)
        # on_stream's exit waited for the copies: the host tensors are complete
        for rows, host, motion in copies:
            for row, i in enumerate(rows):
                frames_out[i], motion_out[i] = host[row].numpy(), motion[row:row + 1]
        return frames_out, motion_out

    @torch.no_grad()
    def warm(self, part: str, rows: int) -> None:
        """A batch of every size ``denoise`` or ``decode`` (``part``) runs for up to ``rows`` streams (denoise: at
        both motion lengths), on a grey portrait, results dropped: cuDNN's benchmark mode times a convolution
        once per shape and thread, and graphed, each batch's graph is captured, before sessions wait on them."""
        cfg = self.cfg
        stream = ChunkMotionStream(self.model, self.vae, torch.zeros(1, 3, 1, cfg.height, cfg.width))
        tokens = np.zeros((cfg.latents_per_chunk, cfg.audio_tokens, cfg.dim), np.float32)
        self._capturing = True
        try:
            for size in (1 << k for k in range(rows.bit_length())):  # batch_groups' sizes: 1, 2, 4, ... <= rows
                if part == "denoise":
                    for m in sorted({1, cfg.motion_latents}):  # a first chunk continues one latent
                        stream.motion = stream.reference[:, :, :m]
                        self.denoise([stream] * size, [tokens] * size)
                else:  # the reference latents have a chunk's shape
                    self.decode([stream] * size, [stream.reference] * size)
        finally:
            self._capturing = False


def _announce(leads: list[Callable[[np.ndarray], None] | None], rows: list[int], host: Tensor, frames: int) -> None:
    for row, i in enumerate(rows):
        if leads[i] is not None:
            leads[i](host[row, :frames].numpy())


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static: copied into before each replay
    outputs: tuple[Tensor, ...]  # static: rewritten by each replay


def batch_groups(rows: list[int]) -> list[list[int]]:
    """``rows`` in groups of power-of-two sizes, largest first (13 rows: 8, 4, 1). A batch then comes in
    a few shapes only: cuDNN's benchmark mode times every convolution once per new shape (per thread),
    which for batches of every size would stall sessions for seconds, time and again; a few rows more
    per forward gain little over the largest power of two (a Lite row costs 30.5 ms of DiT at 16, 31.2
    at 4)."""
    groups = []
    while rows:
        size = 1 << (len(rows).bit_length() - 1)
        groups.append(rows[:size])
        rows = rows[size:]
    return groups


class ChunkMotionStream:
    def __init__(self, dit: FlashHeadDiT, vae: WanVAE | LtxVAE, portrait: Tensor, seed: int = 0,
                 compiled: bool = False) -> None:
        """``dit`` and ``vae`` may be shared with other sessions' streams: a stream keeps its state (motion
        latents, noise, colour reference) to itself. ``compiled``: its runner's DiT and VAE through
        ``torch.compile`` (one compilation per process: later streams reuse it)."""
        cfg = dit.cfg
        if tuple(portrait.shape) != (1, 3, 1, cfg.height, cfg.width):
            raise ValueError(f"portrait must be (1, 3, 1, {cfg.height}, {cfg.width}), got {tuple(portrait.shape)}")
        self.cfg, self.compiled = cfg, compiled
        # a runner and CUDA stream of its own: sessions sharing the model on threads wait only for their own
        # work (a copy to the host synchronises this stream, not the device)
        self.runner = ChunkRunner(dit, vae, compiled)
        self.cuda_stream = self.runner.cuda_stream
        device = next(dit.parameters()).device
        self.generator = torch.Generator(device).manual_seed(seed)
        with torch.no_grad(), self.runner.on_stream():
            still = portrait.to(device).expand(-1, -1, cfg.frames_per_chunk, -1, -1)
            self.reference = self.runner.encode(still, [self.generator])  # (1, C, latents, h, w), once per session
            self.colours: ColourReference = colour_reference(portrait.to(device))
        # the first chunk continues the portrait: its first latent, as the released pipeline starts
        self.motion = self.reference[:, :, :1].clone()
        self.chunks = 0
        self.start = 0  # the media frame the chunk being made starts at
        # media frame -> the motion latents of the chunk that ended there; frame 0 has the portrait's, so a
        # rollback to the start continues the portrait as the first chunk does
        self._motion_at: OrderedDict[int, Tensor] = OrderedDict({0: self.motion})
        self._shown: deque[tuple[int, np.ndarray]] = deque(maxlen=KEEP_FRAMES)  # (first frame, frames) by chunk
        self._portrait = to_pixels(portrait[0, :, 0].permute(1, 2, 0)).numpy()
        self._decoded = threading.Event()  # the motion latents of the last chunk are in place
        self._decoded.set()
        self.closed = False

    def ready(self, chunk: int | None = None, timeout: float | None = None, start: int | None = None) -> None:
        """Wait until the last chunk given is decoded, then take the motion latents of the chunk starting at
        media frame ``start`` (default: chunk ``chunk``'s on the unshifted grid; neither: where the last one
        ended): those the chunk that ended there left, else its frames before ``start`` re-encoded (after a
        re-phased rollback). Then the chunk may be denoised (here or in a batch)."""
        if not self._decoded.wait(timeout):
            raise TimeoutError(f"the previous chunk was not decoded within {timeout} s")
        if self.closed:
            raise RuntimeError("the chunk stream is closed")
        self._decoded.clear()
        if start is None and chunk is not None:
            start = chunk * self.cfg.new_frames_per_chunk
        if start is not None and start != self.start:
            self.motion = self._motion_before(start)
            self.start = start

    def _motion_before(self, start: int) -> Tensor:
        """The motion latents a chunk starting at media frame ``start`` continues from."""
        motion = self._motion_at.get(start)
        if motion is not None:
            return motion
        frames = self._frames_before(start)
        if frames is None:  # not kept (shown too long ago, or never made): continue the last chunk made
            return self.motion
        return self._encode_frames(frames, self.generator)

    def _encode_frames(self, frames: np.ndarray, generator: torch.Generator) -> Tensor:
        """Motion latents of ``frames`` (frames, H, W, 3) uint8."""
        device = self.reference.device
        with torch.no_grad(), self.runner.on_stream():
            pixels = to_unit(torch.from_numpy(frames).to(device).permute(3, 0, 1, 2)[None]).contiguous()
            return self.runner.encode(pixels, [generator])

    def warm_thread(self) -> None:
        """Re-encode the frames before media frame 0 once on the calling thread, result dropped (its noise
        from a generator of its own: the stream's draws are unchanged). PyTorch keeps cuDNN's timed
        convolution plans per thread, so the thread that makes a session's re-phased turn starts would
        otherwise time the encode's convolutions inside its first turn: that chunk's step took 776 and
        1,040 ms on an H100 where later turns' took ~320."""
        self._encode_frames(self._frames_before(0), torch.Generator(self.reference.device).manual_seed(0))

    def _frames_before(self, start: int) -> np.ndarray | None:
        """The ``motion_frames`` frames shown before media frame ``start`` (the portrait before the first), or
        None where one is no longer kept. The latest chunk decoded over a frame is the one shown there."""
        frames = []
        for at in range(start - self.cfg.motion_frames, start):
            frame = self._portrait if at < 0 else next(
                (shown[at - first] for first, shown in reversed(self._shown) if first <= at < first + len(shown)), None)
            if frame is None:
                return None
            frames.append(frame)
        return np.stack(frames)

    def denoise(self, audio_tokens: np.ndarray | Tensor, chunk: int | None = None, timeout: float | None = None,
                start: int | None = None) -> Tensor:
        """Chunk ``chunk``'s latents (1, C, latents, h, w) from its audio tokens (latents, tokens, d), by this
        stream's runner, once ready (``ready``). The latents are complete when it returns, so any thread may
        read them."""
        self.ready(chunk, timeout, start)
        return self.runner.denoise([self], [audio_tokens])[0]

    def decode(self, latents: Tensor, lead: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """The chunk's new frames colour-matched to the portrait, uint8 (new_frames_per_chunk, H, W, 3), by this
        stream's runner; its last frames become the next chunk's motion latents. ``lead``: called with the
        first ``lead_frames`` frames while the rest decodes (``ChunkRunner.decode``)."""
        (frames,), (motion,) = self.runner.decode([self], [latents], [lead])
        self.decoded(motion, frames)
        return frames

    def decoded(self, motion: Tensor, frames: np.ndarray | None = None) -> None:
        """The chunk made last is decoded into ``frames`` (kept, where given) and left ``motion``: the next chunk
        may start from it."""
        end = self.start + self.cfg.new_frames_per_chunk
        if frames is not None:
            self._shown.append((self.start, frames))
        self.motion, self.start = motion, end
        self._motion_at[end] = motion
        self._motion_at.move_to_end(end)
        while len(self._motion_at) > KEEP_MOTION:
            self._motion_at.popitem(last=False)
        self.chunks += 1
        self._decoded.set()

    def skip(self) -> None:
        """The last chunk denoised will not be decoded (a rollback made it stale, or its message came
        malformed): the next ``denoise`` may start, from the motion latents of the chunk before its own."""
        self._decoded.set()

    def close(self) -> None:
        """The session ends: a ``denoise`` waiting for a decode that will not come returns (raising)."""
        self.closed = True
        self._decoded.set()
