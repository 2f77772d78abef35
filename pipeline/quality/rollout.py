"""Generate held-out clips and long sessions with the trained character, and score their lip sync.

A ``GateConfig`` names the cache mode the DiT runs with:
- ``naive``: model/naive.py, raw K/V re-rotated every step, model in ``dtype`` (the bf16 baseline);
- ``ring``: model/generator.py, the KV ring cache (FP8 e4m3 with per-head scales when ``fp8``).
``fault`` breaks the ring on purpose, through a hook on the cache (the gate must fail these):
- ``scale_x4``: attention reads the FP8 keys with 4x their per-head scale;
- ``rope_off_by_one``: every frame's keys are written one frame later in time than its queries.

Audio tokens come from the trained audio encoder over the whole clip (equal to the streamed
windows, model/audio_encoder.py); frames from the causal VAE decoder over blocks of latents.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from charstream.model.character import MOUTH_BOX, Motion, make_identity, reference_frame, render
from charstream.model.config import get_preset
from charstream.model.generator import Generator
from charstream.model.naive import NaiveGenerator
from charstream.model.step import StepOptions
from charstream.model.vae import to_uint8_frames
from charstream.model.weights import build_model, load_audio_encoder, load_vae, packaged_weights
from charstream.pipeline.quality.lipsync import (
    SyncScore,
    box_openness,
    mouth_openness,
    speech_envelope,
    sync_score,
)
from charstream.pipeline.training.data import make_script
from charstream.timeline import SAMPLES_PER_CHUNK, VIDEO_FPS

CONFIG_DIR = Path(__file__).parent / "configs"
CACHES = ("naive", "ring")
FAULTS = (None, "scale_x4", "rope_off_by_one")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class GateConfig:
    name: str
    cache: str = "ring"
    fp8: bool = True
    fault: str | None = None
    dtype: str = "float32"
    weights: str | None = None  # default: the packaged model/assets/tiny.safetensors
    device: str = "cpu"
    identity: int = 0  # the character every clip is generated with (the demo's)
    graphed: bool = False  # CUDA only: the step as CUDA graphs (model/step/), as the GPU demo runs

    def __post_init__(self) -> None:
        if self.cache not in CACHES:
            raise ValueError(f"config {self.name!r}: cache {self.cache!r} is not one of {CACHES}")
        if self.fault not in FAULTS:
            raise ValueError(f"config {self.name!r}: fault {self.fault!r} is not one of {FAULTS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"config {self.name!r}: dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.fault is not None and self.cache != "ring":
            raise ValueError(f"config {self.name!r}: faults break the ring cache; cache must be 'ring'")
        if self.graphed and (self.cache != "ring" or not self.fp8 or self.dtype != "bfloat16" or self.fault):
            raise ValueError(f"config {self.name!r}: the graphed step is the FP8 ring with a bfloat16 model, unbroken")


def load_config(spec: str | Path) -> GateConfig:
    """A JSON file, or the name of a built-in config (``pipeline/quality/configs/<name>.json``)."""
    path = Path(spec)
    if not path.exists():
        path = CONFIG_DIR / f"{spec}.json"
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
            raise FileNotFoundError(f"no config file {spec!r} and no built-in config of that name ({known})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of GateConfig's keys")
    allowed = {f.name for f in fields(GateConfig)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown config keys {unknown}; allowed: {sorted(allowed)}")
    return GateConfig(**data)


def _break_ring(gen: Generator, fault: str) -> None:
    """The fault hook: wrap the cache's read or write path of this generator instance."""
    cache = gen.cache
    if fault == "scale_x4":
        attend = cache.attend

        def attend_x4(layer: int, q: torch.Tensor) -> torch.Tensor:
            cache.k_scale[layer].mul_(4.0)
            try:
                return attend(layer, q)
            finally:
                cache.k_scale[layer].div_(4.0)

        cache.attend = attend_x4
    elif fault == "rope_off_by_one":
        write = cache.write

        def write_late(layer: int, k_new, v_new, positions: torch.Tensor, rotation=None) -> None:
            shifted = positions.clone()
            if not cache.writing_sink:
                shifted[:, 0] += 1
            write(layer, k_new, v_new, shifted)  # the caller's RoPE tables are for the true positions: dropped

        cache.write = write_late


def _frames(motion: Motion, start: int, stop: int) -> Motion:
    return Motion(*(getattr(motion, f.name)[start:stop] for f in fields(Motion)))


class Rollout:
    """One side of the gate: trained weights + a cache mode, generating and scoring clips."""

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self.cfg = get_preset("tiny")
        weights = Path(config.weights) if config.weights else packaged_weights("tiny")
        if weights is None or not weights.exists():
            raise FileNotFoundError("no trained weights: model/assets/tiny.safetensors is missing "
                                    "(run `charstream train`, docs/QUALITY.md)")
        device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        self.device = device
        self.vae = load_vae(self.cfg, weights, device)
        self.audio_encoder = load_audio_encoder(self.cfg, weights, device)
        # The naive path keeps fp32 weights and computes in ``dtype`` under autocast (its raw K/V
        # history then holds that dtype too); the ring path builds the model in ``dtype``.
        self.autocast = dtype != torch.float32 and config.cache == "naive"
        self.dtype = dtype
        if config.cache == "naive":
            self.gen = NaiveGenerator(build_model(self.cfg, weights, device, torch.float32))
        else:
            self.gen = Generator(self.cfg, weights, device, dtype=dtype, fp8_cache=config.fp8,
                                 options=StepOptions(fused=config.graphed, graphed=config.graphed))
            if config.fault:
                _break_ring(self.gen, config.fault)

    @torch.inference_mode()
    def latents(self, audio: np.ndarray, seed: int, identity: int | None = None) -> torch.Tensor:
        """Latent frames (n_chunks, C, h, w) for ``audio`` (48 kHz int16); chunk n samples with seed (seed, n)."""
        ident = self.config.identity if identity is None else identity
        ref = reference_frame(ident, self.device).float()[None] / 127.5 - 1.0
        ref_latent = self.vae.encode_image(ref)[0]
        tokens = self.audio_encoder.encode_clip(audio)
        out = []
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            self.gen.reset_session(ref_latent)
            for n in range(len(audio) // SAMPLES_PER_CHUNK):
                out.append(self.gen.step(tokens[n], seed=seed * 1_000_003 + n).float())
        return torch.stack(out)

    @torch.inference_mode()
    def decoded(self, audio: np.ndarray, seed: int, block: int = 64) -> Iterator[torch.Tensor]:
        """Generated video in blocks of up to ``block`` latent frames, each (frames, 3, H, W) in [-1, 1].
        The causal decoder's state is threaded through, which equals decoding chunk by chunk as the
        demo does."""
        latents = self.latents(audio, seed)
        state = None
        for start in range(0, latents.shape[0], block):
            video, state = self.vae.decode(latents[None, start: start + block], state)
            yield video[0]

    def video(self, audio: np.ndarray, seed: int) -> torch.Tensor:
        """The whole generated clip as uint8 frames (frames, H, W, 3)."""
        return torch.cat([to_uint8_frames(v) for v in self.decoded(audio, seed)])

    def openness(self, audio: np.ndarray, seed: int) -> np.ndarray:
        """Mouth openness per generated frame."""
        y0, y1, x0, x1 = MOUTH_BOX
        crops = (to_uint8_frames(v[:, :, y0:y1, x0:x1]) for v in self.decoded(audio, seed))  # (frames, h, w, 3)
        return np.concatenate([box_openness(c.permute(0, 3, 1, 2).cpu().numpy()) for c in crops])

    def score_clip(self, clip_seed: int, rerun_seed: int, n_frames: int) -> SyncScore:
        """Lip sync of held-out clip ``clip_seed`` (speech only: the character is the config's)."""
        audio = make_script(clip_seed, n_frames, "heldout").audio
        return sync_score(self.openness(audio, rerun_seed), speech_envelope(audio))

    def session(self, seed: int, minutes: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One long held-out session: generated mouth openness per frame, the same for the
        ground-truth render of its speech (the scorer's ceiling, window by window), and the audio."""
        n_frames = int(minutes * 60 * VIDEO_FPS) // 4 * 4
        script = make_script(10_000 + seed, n_frames, "heldout")
        ident = make_identity(self.config.identity)
        truth = [mouth_openness(render(ident, _frames(script.motion, start, start + 1200), self.device).cpu().numpy())
                 for start in range(0, n_frames, 1200)]
        return self.openness(script.audio, seed), np.concatenate(truth), script.audio

    @staticmethod
    def window_scores(openness: np.ndarray, audio: np.ndarray, window_s: float) -> tuple[list[float], list[float]]:
        """(window centre seconds, confidence) over consecutive windows of a session."""
        env = speech_envelope(audio)
        w = int(window_s * VIDEO_FPS)
        times, scores = [], []
        for start in range(0, len(openness) - w + 1, w):
            times.append((start + w / 2) / VIDEO_FPS)
            scores.append(sync_score(openness[start: start + w], env[start: start + w]).confidence)
        return times, scores
