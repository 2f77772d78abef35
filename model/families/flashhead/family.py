"""SoulX-FlashHead as a model family: Pro (Wan2.1 VAE) and Lite (LTX-Video VAE)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from charstream.model.families.base import (
    AudioConditioner,
    CheckpointReport,
    GenerationMode,
    ModelFamily,
    meta_flops,
)
from charstream.model.families.flashhead.config import VARIANTS, FlashHeadConfig
from charstream.model.families.flashhead.loader import (
    LTX_VAE_DIR,
    WAV_VAE,
    FlashHeadModel,
    inspect_folder,
    load_audio_side,
    load_dit,
    load_flashhead,
    used_shapes,
)
from charstream.timeline import Timeline

if TYPE_CHECKING:
    from charstream.model.families.flashhead.chunks import ChunkMotionStream, ChunkRunner
    from charstream.model.families.flashhead.dit import FlashHeadDiT
    from charstream.model.families.flashhead.vae_ltx import LtxVAE
    from charstream.model.families.flashhead.vae_wan import WanVAE


class FlashHeadFamily(ModelFamily):
    variants = tuple(VARIANTS)

    def __init__(self, variant: str, audio_encoder: str | Path | None = None,
                 config: FlashHeadConfig | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown FlashHead variant {variant!r} (known: {', '.join(VARIANTS)})")
        self.variant = variant
        self._config = config or VARIANTS[variant]  # another size of the variant (tests: fewer blocks)
        self.name = self._config.name
        self.audio_encoder = audio_encoder  # wav2vec2-base-960h, if not in or beside the weights folder

    @property
    def config(self) -> FlashHeadConfig:
        return self._config

    @property
    def timeline(self) -> Timeline:
        cfg = self.config
        return Timeline(fps=cfg.fps, frames_per_chunk=cfg.new_frames_per_chunk)

    @property
    def generation_mode(self) -> GenerationMode:
        return "chunk_motion"

    def parameter_count(self) -> int:
        return sum(torch.Size(s).numel() for s in used_shapes(self.config).values())

    def flops_per_chunk(self) -> dict[str, int]:
        """The audio window's encode (wav2vec2 over the whole context + the adapter), the DiT's passes, the VAE
        decode of the chunk's frames and the re-encode of its last frames into the next chunk's motion latents."""
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        from charstream.model.families.flashhead.audio import AudioAdapter, SpeechFeatures
        from charstream.model.families.flashhead.conditioner import ChunkSpeechEncoder
        from charstream.model.families.flashhead.dit import FlashHeadDiT
        from charstream.model.families.flashhead.vae_ltx import LtxVAE
        from charstream.model.families.flashhead.vae_wan import WanVAE

        cfg = self._config

        def latents() -> Tensor:
            return torch.zeros(1, cfg.latent_channels, cfg.latents_per_chunk, *cfg.latent_grid)

        def audio() -> None:
            # wav2vec2-base's sizes; the library builds on the CPU whatever the default device
            speech = SpeechFeatures(Wav2Vec2Model(Wav2Vec2Config()).to("meta"))
            encoder = ChunkSpeechEncoder(cfg, speech, AudioAdapter(cfg))
            encoder.tokens(torch.zeros(1, encoder.window_samples, dtype=torch.int16))

        def denoise() -> None:
            audio_tokens = torch.zeros(1, cfg.latents_per_chunk, cfg.audio_tokens, cfg.dim)
            FlashHeadDiT(cfg)(latents(), latents(), torch.zeros(1), audio_tokens)

        def vae() -> WanVAE | LtxVAE:
            return (LtxVAE if self.variant == "lite" else WanVAE)(cfg.vae_width)

        return {
            "audio_encode": meta_flops(audio),
            "denoise": len(cfg.sigmas) * meta_flops(denoise),
            "decode": meta_flops(lambda: vae().decode_chunk(latents())),
            "motion_encode": meta_flops(lambda: vae().encode_motion(torch.zeros(1, 3, cfg.motion_frames,
                                                                                cfg.height, cfg.width))),
        }

    def inspect(self, weights_dir: str | Path) -> CheckpointReport:
        return inspect_folder(weights_dir, self.variant, self.audio_encoder)[0]

    def load(
        self, weights: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> FlashHeadModel:
        return load_flashhead(weights, self.variant, device, dtype, seed, self.audio_encoder, self._config)

    def audio_conditioner(self, weights: str | None, device: str = "cpu", seed: int = 0,
                          graphed: bool = True) -> AudioConditioner:
        from charstream.model.families.flashhead.conditioner import ChunkSpeechEncoder

        adapter, speech = self._shared("audio", weights, device, seed, lambda w: load_audio_side(
            w, self.variant, device, seed, self.audio_encoder, self._config))
        graphed = graphed and str(device).startswith("cuda")
        encoder = self._shared("audio-graphed" if graphed else "audio-encoder", weights, device, seed,
                               lambda w: ChunkSpeechEncoder(self._config, speech, adapter, graphed))
        return AudioConditioner(encoder.encode, encoder.context_ms, 0.0, encode_batch=encoder.encode_batch)

    def chunk_stream(self, weights: str | None, portrait: np.ndarray, device: str = "cpu", seed: int = 0,
                     compiled: bool | None = None) -> ChunkMotionStream:
        """One session's chunk stream (``chunks.py``) over this process's DiT and VAE (``generator``): the
        ``portrait`` (RGB uint8) encoded once, the session's own noise stream from ``seed``. ``compiled``:
        the DiT pass and the VAE through ``torch.compile`` (None: on CUDA)."""
        from charstream.model.families.flashhead.chunks import ChunkMotionStream, portrait_tensor

        dit, vae = self.generator(weights, device, seed)
        cfg = self._config
        compiled = str(device).startswith("cuda") if compiled is None else compiled
        return ChunkMotionStream(dit, vae, portrait_tensor(portrait, cfg.height, cfg.width), seed, compiled=compiled)

    def chunk_runner(self, weights: str | None, device: str = "cpu", seed: int = 0, compiled: bool | None = None,
                     batched: bool = False, graphed: bool = False) -> ChunkRunner:
        """A runner of chunks over this process's DiT and VAE, on a CUDA stream of its own: ``batched``, one
        that several sessions' streams share (the batchers'), compiled for every batch size; ``graphed``, on
        CUDA, a CUDA graph per batch size."""
        from charstream.model.families.flashhead.chunks import ChunkRunner

        dit, vae = self.generator(weights, device, seed)
        compiled = str(device).startswith("cuda") if compiled is None else compiled
        return ChunkRunner(dit, vae, compiled, batched, graphed)

    def warm_up(self, weights: str | None, device: str, seed: int = 0, batched: bool = False) -> float:
        """The shared DiT and VAE loaded and, on CUDA, compiled: one chunk of silence through a grey
        portrait (torch.compile's first calls are slow; later streams reuse what it built); ``batched``:
        then a batch of two through a batched runner, as the batchers run them. Later calls reuse
        what these compiled and never compile again in this process."""
        if not str(device).startswith("cuda"):
            return 0.0
        started = time.perf_counter()
        cfg = self._config
        grey = np.full((cfg.height, cfg.width, 3), 128, np.uint8)
        silence = np.zeros((cfg.latents_per_chunk, cfg.audio_tokens, cfg.dim), np.float32)
        streams = [self.chunk_stream(weights, grey, device, seed) for _ in range(2 if batched else 1)]
        streams[0].decode(streams[0].denoise(silence))
        streams[0].ready(start=cfg.new_frames_per_chunk // 2)  # a re-phased chunk: motion re-encoded from frames
        streams[0].skip()
        if batched:
            runner = self.chunk_runner(weights, device, seed, batched=True)
            for chunk in range(2):  # a batch of two (one row is the stream's compilation), as the batchers run them
                for s in streams:
                    s.ready(chunk)
                latents = runner.denoise(streams, [silence] * 2)
                for s, motion in zip(streams, runner.decode(streams, latents)[1], strict=True):
                    s.decoded(motion)
        for s in streams:
            s.close()
        # Nothing compiles after this: an unforeseen shape runs eager. The sessions call the compiled code on
        # their threads, and torch.compile's tracing is process-wide: a compiled call on one thread fails
        # while another thread compiles (and a compile would stall every session for a minute).
        torch.compiler.set_stance("eager_on_recompile")
        return time.perf_counter() - started

    def generator(self, weights: str | None, device: str = "cpu", seed: int = 0) -> tuple[FlashHeadDiT, WanVAE | LtxVAE]:
        """The DiT and the VAE of ``weights`` (a released folder, or None / ``"random"``: seeded random
        weights of this config; the VAE from ``VAE_Wan/Wan2.1_VAE.pth`` for Pro, ``VAE_LTX/`` for Lite), bf16
        on CUDA, fp32 elsewhere. Shared by the process's sessions (a chunk's passes keep no state in the
        modules), so a second session costs its latents, not another 1.3 B parameters."""

        def load(weights: str | Path) -> tuple[FlashHeadDiT, WanVAE | LtxVAE]:
            from charstream.model.families.flashhead.vae_ltx import load_ltx_vae, random_ltx_vae
            from charstream.model.families.flashhead.vae_wan import load_wan_vae, random_wan_vae

            width = self._config.vae_width
            if weights != "random" and width != 1.0:
                raise ValueError(f"a VAE of width {width} has random weights only: {weights} holds the released VAE")
            cuda = str(device).startswith("cuda")
            if cuda:
                torch.backends.cudnn.benchmark = True  # cuDNN's fastest conv per VAE shape, chosen once
            dtype = torch.bfloat16 if cuda else torch.float32
            dit = load_dit(weights, self.variant, device, dtype, seed, self.audio_encoder, self._config)
            if self.variant == "lite":
                return dit, (random_ltx_vae(seed, device, dtype, width) if weights == "random"
                             else load_ltx_vae(Path(weights) / LTX_VAE_DIR, device, dtype))
            return dit, (random_wan_vae(seed, device, dtype, width) if weights == "random"
                         else load_wan_vae(Path(weights) / WAV_VAE, device, dtype))

        return self._shared("generator", weights, device, seed, load)

    def _shared(self, part: str, weights: str | None, device: str, seed: int, load: Callable[[str | Path], Any]) -> Any:
        """``load(weights)`` once per process for this config, weights and device (and seed, for random ones)."""
        weights = _weights(weights)
        key = (part, self._config, str(weights), str(device), seed if weights == "random" else None)
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = load(weights)
            return _SHARED[key]


_SHARED: dict[tuple, Any] = {}  # a serving process's FlashHead modules, by part, config, weights, device
_SHARED_LOCK = threading.Lock()


def _weights(weights: str | Path | None) -> str | Path:
    """None is seeded random weights, as for every family; FlashHead ships no weights of its own."""
    if weights == "packaged":
        raise ValueError("FlashHead ships no weights: give its weights folder (Soul-AILab/SoulX-FlashHead) or 'random'")
    return "random" if weights is None else weights
