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

A turn start or barge-in drops the unplayed chunks at playout and regenerates from the chunk after the
last one played: the motion latents after each of the last ``KEEP_MOTION`` decoded chunks are kept by
chunk index, so the regenerated chunk continues the frames on screen, not the dropped ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from torch import Tensor

from charstream.model.families.flashhead.colour import ColourReference, colour_reference, match_colours
from charstream.model.families.flashhead.dit import FlashHeadDiT
from charstream.model.families.flashhead.sampler import sample_chunk
from charstream.model.families.flashhead.vae_ltx import LtxVAE
from charstream.model.families.flashhead.vae_wan import WanVAE

KEEP_MOTION = 16  # chunks whose motion latents are kept: more than playout holds unplayed


def portrait_tensor(image: np.ndarray, height: int, width: int) -> Tensor:
    """An RGB uint8 (H, W, 3) portrait -> (1, 3, 1, height, width) in [-1, 1], resized to the video size."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"a portrait is RGB uint8 (H, W, 3), got {image.dtype} {image.shape}")
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 127.5 - 1
    x = torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return x.clamp(-1, 1)[:, :, None]


class ChunkMotionStream:
    def __init__(self, dit: FlashHeadDiT, vae: WanVAE | LtxVAE, portrait: Tensor, seed: int = 0,
                 compiled: bool = False) -> None:
        """``dit`` and ``vae`` may be shared with other sessions' streams: a stream keeps its state (motion
        latents, noise, colour reference) to itself. ``compiled``: the DiT and the VAE's decode and encode
        through ``torch.compile`` (one compilation per process: later streams reuse it)."""
        cfg = dit.cfg
        if tuple(portrait.shape) != (1, 3, 1, cfg.height, cfg.width):
            raise ValueError(f"portrait must be (1, 3, 1, {cfg.height}, {cfg.width}), got {tuple(portrait.shape)}")
        self.vae, self.cfg, self.compiled = vae, cfg, compiled
        device = next(dit.parameters()).device
        self.dtype = next(dit.parameters()).dtype
        # A CUDA stream of its own: sessions sharing the model on threads wait only for their own work
        # (a copy to the host synchronises this stream, not the device).
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.generator = torch.Generator(device).manual_seed(seed)
        self.dit = torch.compile(dit, dynamic=False) if compiled else dit
        self._decode = torch.compile(vae.decode_chunk, dynamic=False) if compiled else vae.decode_chunk
        self._match = torch.compile(match_colours, dynamic=False) if compiled else match_colours
        if cfg.variant == "lite":  # Lite feeds back a sample of the LTX posterior, drawn from the session's noise
            self._encode = partial(vae.encode_motion, generator=self.generator)
        else:
            self._encode = torch.compile(vae.encode_motion, dynamic=False) if compiled else vae.encode_motion
        with torch.no_grad(), self._on_stream():
            still = portrait.to(device).expand(-1, -1, cfg.frames_per_chunk, -1, -1)
            self.reference = self._encode(still).to(self.dtype)  # (1, C, latents, h, w), once per session
            self.colours: ColourReference = colour_reference(portrait.to(device))
            # the first chunk continues the portrait: its first latent, as the released pipeline starts
            self.motion = self.reference[:, :, :1].clone()
        self.initial_motion = self.motion
        self.chunks = 0
        # chunk -> the motion latents it left; "chunk -1" left the portrait's, so a rollback to the start
        # continues the portrait as the first chunk does
        self._motion_after: OrderedDict[int, Tensor] = OrderedDict({-1: self.motion})
        self._decoded = threading.Event()  # the motion latents of the last chunk are in place
        self._decoded.set()
        self.closed = False

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Work on the session's stream, after what the calling thread's stream has queued (its inputs)."""
        if self.cuda_stream is None:
            yield
            return
        self.cuda_stream.wait_stream(torch.cuda.current_stream(self.cuda_stream.device))
        with torch.cuda.stream(self.cuda_stream):
            yield

    @torch.no_grad()
    def denoise(self, audio_tokens: np.ndarray | Tensor, chunk: int | None = None, timeout: float | None = None) -> Tensor:
        """Chunk ``chunk``'s latents (1, C, latents, h, w) from its audio tokens (latents, tokens, d), once the
        last chunk given is decoded; it starts from the motion latents chunk ``chunk - 1`` left (after a
        rollback, an earlier chunk than the last decoded; chunk 0: the portrait's), else from the last ones. The latents are complete
        when it returns (its stream synchronised), so any thread may read them."""
        if not self._decoded.wait(timeout):
            raise TimeoutError(f"the previous chunk was not decoded within {timeout} s")
        if self.closed:
            raise RuntimeError("the chunk stream is closed")
        self._decoded.clear()
        if chunk is not None:
            self.motion = self._motion_after.get(chunk - 1, self.motion)
        with self._on_stream():
            audio = torch.as_tensor(audio_tokens)[None].to(self.reference.device, self.dtype)
            latents = sample_chunk(self.dit, self.reference, audio, self.motion, self.generator)
        if self.cuda_stream is not None:
            self.cuda_stream.synchronize()
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor, chunk: int | None = None) -> np.ndarray:
        """The chunk's new frames colour-matched to the portrait, uint8 (new_frames_per_chunk, H, W, 3); its
        last frames become the next chunk's motion latents."""
        with self._on_stream():
            cfg = self.cfg
            weight = next(self.vae.parameters())
            frames = self._decode(torch.as_tensor(latents).to(weight.device, weight.dtype))  # (1, 3, F, H, W)
            # what is shown is colour-matched, as the released pipeline shows it; its last frames feed the next chunk
            new = self._match(frames[:, :, cfg.motion_frames:].float(), self.colours)
            self.motion = self._encode(new[:, :, -cfg.motion_frames:]).to(self.dtype)
            if chunk is not None:
                self._motion_after[chunk] = self.motion
                while len(self._motion_after) > KEEP_MOTION:
                    self._motion_after.popitem(last=False)
            self.chunks += 1
            self._decoded.set()
            return ((new[0].permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    def skip(self) -> None:
        """The last chunk denoised will not be decoded (a rollback made it stale, or its message came
        malformed): the next ``denoise`` may start, from the motion latents of the chunk before its own."""
        self._decoded.set()

    def close(self) -> None:
        """The session ends: a ``denoise`` waiting for a decode that will not come returns (raising)."""
        self.closed = True
        self._decoded.set()
