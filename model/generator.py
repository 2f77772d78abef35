"""One rank's generator: its shard of the DiT, its KV ring cache and the diffusion step over them.

    gen = Generator(cfg, weights, device, tp_group=None)
    gen.reset_session(reference_latent)          # writes the sink frame, fixes FP8 scales
    latent = gen.step(audio_tokens, seed)        # one chunk: 4 passes, last pass's K/V stay
    gen.rollback(k)                              # turn-start rollback: forget the last k frames

The step is ``model.step.DiffusionStep`` with the given ``StepOptions``; by default it takes the fused FP8
body, CUDA-graphed, on a CUDA device with a bf16 model and an FP8 ring, and the module body elsewhere. Under TP every rank
runs the same calls with the same inputs (rank 0 does the I/O and broadcasts: stages/diffusion/tp_group.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from charstream.kernels.fp8 import FP8_DTYPE
from charstream.kernels.rope import rope_freqs
from charstream.model.cache import KVCache
from charstream.model.config import ModelConfig
from charstream.model.step import DiffusionStep, StepOptions
from charstream.model.step.options import DEFAULTS
from charstream.model.weights import build_model


class Generator:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: str | Path | None = None,
        device: torch.device | str = "cpu",
        tp_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        fp8_cache: bool = True,
        cache_slots: int | None = None,
        seed: int = 0,
        options: StepOptions = DEFAULTS,
    ) -> None:
        world = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.cfg = cfg.validate(world)
        self.device = torch.device(device)
        self.model = build_model(cfg, weights, self.device, dtype, tp_group, seed)
        self.freqs = rope_freqs(cfg.head_dim, self.device)
        kv_dtype = FP8_DTYPE if fp8_cache else dtype
        self.cache = KVCache(cfg, cfg.n_heads // world, kv_dtype, self.device, self.freqs, n_slots=cache_slots)
        self.diffusion = DiffusionStep(self.model, self.cache, tp_group, options)

    @property
    def next_frame(self) -> int:
        """Index (since the session's start) of the frame the next ``step`` generates."""
        return self.cache.next_frame

    def reset_session(self, reference_latent: torch.Tensor) -> None:
        self.diffusion.reset_session(reference_latent)

    def step(self, audio_tokens: torch.Tensor, seed: int) -> torch.Tensor:
        return self.diffusion.step(audio_tokens, seed)

    def rollback(self, k: int) -> int:
        return self.diffusion.rollback(k)
