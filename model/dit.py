"""Parallel-block autoregressive video DiT.

Each block reads ONE normalised input (adaLN on the noise level) and computes three branches from it
-- self-attention of the frame's tokens over the cached context plus themselves, cross-attention to
the chunk's audio tokens, and a GELU MLP -- then sums them. The branches' input projections are one
fused GEMM (``w_in`` -> q, k, v, cross-q, mlp-up) and their output projections another (``w_out`` over
the concatenated [attn, cross, mlp] outputs), so tensor parallelism splits ``w_in`` by columns and
``w_out`` by rows and needs exactly one all-reduce per block (model/tp.py adds it as a hook).

Tensors are frame-structured: x is (batch, frames, tokens_per_frame, dim); a frame's tokens are its
video tokens (the patched latent grid, row-major) followed by its audio tokens. How frames attend to
each other is the caller's business: ``forward`` takes a ``SelfAttention`` -- the KV ring cache at
inference (model/generator.py), a block-causal mask in training (model/teacher_forcing.py), the
naive re-RoPE window in tests (model/naive.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from charstream.model.config import ModelConfig

NOISE_FEATURES = 256  # sinusoidal features of the noise level


class SelfAttention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: (B, F, T, heads, head_dim), QK-normed, before RoPE. Returns the same shape."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32, back to x's dtype, then the weight (kernels/ring_write.py fuses the same)
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


def noise_features(sigma: torch.Tensor) -> torch.Tensor:
    """Sinusoidal features (..., NOISE_FEATURES) of noise levels in [0, 1]."""
    half = NOISE_FEATURES // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=sigma.device, dtype=torch.float32) / half)
    angles = sigma.float()[..., None] * 1000.0 * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class Modulation(NamedTuple):
    """adaLN outputs for noise levels (B, F), each (B, F, 1, dim): per block (shift, 1 + scale, gate),
    then the final (shift, 1 + scale). The sampler's levels are fixed, so inference computes one per
    level per session (model/generator.py); training computes them in every forward (gradients)."""

    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    final: tuple[torch.Tensor, torch.Tensor]


def _cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over (B, F, H, n, D) in plain math: with a handful of audio keys, SDPA's fused CPU
    kernel costs more than the three ops."""
    scores = torch.matmul(q, k.mT) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


_GELU_C = 2.0 * math.sqrt(2.0 / math.pi)  # gelu_tanh(x) = x * sigmoid(_GELU_C * (x + 0.044715 x^3))


def _gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` (into ``out`` if given). On CPU in fp32 without autograd as
    x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)), the same function (0.5 (1 + tanh(z)) = sigmoid(2z)) in
    place on one new tensor: the CPU's tanh kernel costs ~2x its sigmoid, and its GELU kernel more than
    the five passes here."""
    if torch.is_grad_enabled() or not x.is_cpu or x.dtype != torch.float32:  # CUDA / bf16: unchanged
        y = F.gelu(x, approximate="tanh")
        return y if out is None else out.copy_(y)
    z = x.square().mul_(0.044715 * _GELU_C).add_(_GELU_C).mul_(x)
    return torch.mul(z.sigmoid_(), x, out=out) if out is not None else z.sigmoid_().mul_(x)


class ParallelBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Local sizes: model/tp.py divides heads and ffn by the TP size when it shards the block.
        self.n_heads, self.head_dim, self.ffn_dim = cfg.n_heads, cfg.head_dim, cfg.ffn_dim
        hd = cfg.n_heads * cfg.head_dim
        self.norm = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.modulation = nn.Parameter(torch.zeros(3, cfg.dim))  # this block's offset to the shared adaLN
        self.w_in = nn.Linear(cfg.dim, 4 * hd + cfg.ffn_dim, bias=False)  # [q | k | v | cross-q | mlp-up]
        self.w_out = nn.Linear(2 * hd + cfg.ffn_dim, cfg.dim, bias=False)  # over [attn | cross | mlp]
        self.w_cross_kv = nn.Linear(cfg.dim, 2 * hd, bias=False)  # audio context -> [cross-k | cross-v]
        self.q_norm = RMSNorm(cfg.head_dim)
        self.k_norm = RMSNorm(cfg.head_dim)  # QK-norm also bounds key magnitudes: good for FP8 scales
        self.cross_q_norm = RMSNorm(cfg.head_dim)
        self.cross_k_norm = RMSNorm(cfg.head_dim)

    def cross_context(self, audio_ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K/V (B, F, heads, A, head_dim) from the audio context (B, F, A, dim)."""
        kv = self.w_cross_kv(audio_ctx).unflatten(-1, (2, self.n_heads, self.head_dim))
        k, v = self.cross_k_norm(kv[..., 0, :, :]), kv[..., 1, :, :]
        # contiguous once here: every pass of the step reads them
        return k.transpose(-3, -2).contiguous(), v.transpose(-3, -2).contiguous()

    def _head_norms(self, qkvc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_norm(q), k_norm(k), cross_q_norm(cq) of (..., 4, heads, head_dim) = [q | k | v | cq] in one
        RMS normalisation (v's share is discarded): RMSNorm's math, a third of the calls."""
        w_q, w_k, w_cq = self.q_norm.weight, self.k_norm.weight, self.cross_q_norm.weight
        weight = torch.stack([w_q, w_k, w_k, w_cq])[:, None]  # (4, 1, head_dim); v's row is unused
        xf = qkvc.float()
        # F.rms_norm's own ops spelled out: on CPU its per-call overhead costs ~40 us x 12 calls a step
        normed = (xf * xf.square().mean(-1, keepdim=True).add_(self.q_norm.eps).rsqrt_()).to(qkvc.dtype) * weight
        q, k, _, cq = normed.unbind(-3)
        return q, k, cq

    def forward(
        self,
        x: torch.Tensor,
        modulation: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cross_kv: tuple[torch.Tensor, torch.Tensor],
        self_attn: SelfAttention,
        layer: int,
    ) -> torch.Tensor:
        """``modulation``: this block's (shift, 1 + scale, gate) from ``DiT.modulation``."""
        shift, scale, gate = modulation
        # Few, fused ops (CPU inference is bound by per-op overhead): addcmul, and the branch outputs
        # written straight into w_out's input buffer, no flatten copies or concatenation.
        h = torch.addcmul(shift, self.norm(x), scale)
        fused = self.w_in(h)
        hd = self.n_heads * self.head_dim
        qkvc = fused[..., : 4 * hd].unflatten(-1, (4, self.n_heads, self.head_dim))
        q, k, cq = self._head_norms(qkvc)
        attn = self_attn(layer, q, k, qkvc[..., 2, :, :])
        cross = _cross_attention(cq.transpose(-3, -2), *cross_kv).transpose(-3, -2)
        branches = fused.new_empty(*fused.shape[:-1], fused.shape[-1] - 2 * hd)  # [attn | cross | mlp]
        branches[..., :hd].unflatten(-1, (self.n_heads, self.head_dim)).copy_(attn)
        branches[..., hd : 2 * hd].unflatten(-1, (self.n_heads, self.head_dim)).copy_(cross)
        _gelu_tanh(fused[..., 4 * hd :], out=branches[..., 2 * hd :])
        return torch.addcmul(x, gate, self.w_out(branches))  # TP: all-reduced in w_out's hook


class DiT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tp_rank, self.tp_world = 0, 1  # set by model/tp.py when sharded
        patch_dim = cfg.latent_channels * cfg.patch**2
        self.patch_embed = nn.Linear(patch_dim, cfg.dim)
        self.audio_embed = nn.Linear(cfg.audio_dim, cfg.dim)  # audio tokens in the frame's own sequence
        self.audio_context = nn.Linear(cfg.audio_dim, cfg.dim)  # what cross-attention reads
        self.noise_mlp = nn.Sequential(nn.Linear(NOISE_FEATURES, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        # adaLN-single (PixArt-alpha): one modulation shared by all blocks, each adds a learned offset.
        # Per-block adaLN matrices would add 60 x 3 d^2 = 10.6 B parameters to characters-57b.
        self.adaln = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.blocks = nn.ModuleList(ParallelBlock(cfg) for _ in range(cfg.n_blocks))
        self.final_norm = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.final_adaln = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.head = nn.Linear(cfg.dim, patch_dim)

    @torch.no_grad()
    def init_random_(self, seed: int, tp_world: int = 1) -> DiT:
        """Deterministic random weights on any device: Linear ~ U(+-1/sqrt(fan_in)), norms 1, offsets 0.

        ``tp_world``: fan-in of a row-parallel shard is its full width (the shard's width x world).
        """
        gen = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("modulation") or name.endswith("bias"):
                param.zero_()
            else:
                fan_in = param.shape[1] * (tp_world if name.endswith("w_out.weight") else 1)
                bound = 1.0 / math.sqrt(fan_in)
                param.copy_(torch.rand(param.shape, generator=gen, device=param.device) * 2 * bound - bound)
        return self

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, F, C, h, w) -> (B, F, video_tokens, C * p * p), tokens row-major over the grid."""
        p = self.cfg.patch
        b, f, c, h, w = latents.shape
        x = latents.reshape(b, f, c, h // p, p, w // p, p).permute(0, 1, 3, 5, 2, 4, 6)
        return x.reshape(b, f, (h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        p, (gh, gw) = self.cfg.patch, self.cfg.grid
        b, f = tokens.shape[:2]
        x = tokens.reshape(b, f, gh, gw, -1, p, p).permute(0, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, f, -1, gh * p, gw * p)

    def cross_context(self, audio_tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-block cross-attention K/V for audio tokens (B, F, A, audio_dim): once per step, not per pass."""
        ctx = self.audio_context(audio_tokens.to(self.head.weight.dtype))
        return [block.cross_context(ctx) for block in self.blocks]

    def level_modulations(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """adaLN for noise levels ``sigma`` (...): every block's (shift, scale, gate) (..., blocks, 3, dim)
        and the final (shift, scale) (..., 2, dim), as the blocks add them (shared adaLN + offset)."""
        emb = F.silu(self.noise_mlp(noise_features(sigma).to(self.head.weight.dtype)))
        ada = self.adaln(emb).unflatten(-1, (3, self.cfg.dim))
        offsets = torch.stack([block.modulation for block in self.blocks])  # (blocks, 3, dim)
        return ada[..., None, :, :] + offsets, self.final_adaln(emb).unflatten(-1, (2, self.cfg.dim))

    def modulation(self, sigma: torch.Tensor) -> Modulation:
        """``level_modulations`` of levels (B, F) laid out for ``forward``."""
        ada, final = self.level_modulations(sigma)

        def split(m: torch.Tensor) -> list[torch.Tensor]:
            shift, scale, *gate = m.unsqueeze(-2).unbind(dim=-3)  # each (B, F, 1, dim)
            return [shift, 1 + scale, *gate]

        return Modulation([tuple(split(m)) for m in ada.unbind(dim=-3)], tuple(split(final)))

    def forward(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        audio_tokens: torch.Tensor,
        self_attn: SelfAttention,
        cross_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        modulation: Modulation | None = None,
    ) -> torch.Tensor:
        """Flow-matching velocity (B, F, C, h, w) for noisy latents (B, F, C, h, w) at levels ``sigma`` (B, F)
        with the chunks' audio tokens (B, F, A, audio_dim). ``cross_kv`` and ``modulation``: the
        caller's precomputed ``cross_context(audio_tokens)`` and ``modulation(sigma)``."""
        dtype = self.head.weight.dtype
        if cross_kv is None:
            cross_kv = self.cross_context(audio_tokens)
        if modulation is None:
            modulation = self.modulation(sigma)
        video = self.patch_embed(self.patchify(latents.to(dtype)))
        x = torch.cat([video, self.audio_embed(audio_tokens.to(dtype))], dim=2)
        for layer, block in enumerate(self.blocks):
            x = block(x, modulation.blocks[layer], cross_kv[layer], self_attn, layer)
        shift, scale = modulation.final
        x = self.final_norm(x[:, :, : self.cfg.video_tokens]) * scale + shift
        return self.unpatchify(self.head(x))


def step_flops(model: DiT) -> int:
    """Floating-point operations (a multiply-add is 2) of one step (every pass) of ``model`` with its window
    full: the blocks' fused GEMMs, self-attention over the window, cross-attention, the per-pass embeddings
    and the once-a-step cross K/V. Per rank when ``model`` is a tensor-parallel shard (model/tp.py)."""
    cfg = model.cfg
    block = model.blocks[0]
    heads = block.n_heads
    t, a = cfg.tokens_per_step, cfg.n_audio_tokens
    attended = (cfg.sink_frames + cfg.window_frames) * t
    gemm = 2 * t * (block.w_in.weight.numel() + block.w_out.weight.numel())
    attention = 4 * t * attended * cfg.head_dim * heads + 4 * t * a * cfg.head_dim * heads
    replicated = 2 * cfg.video_tokens * cfg.latent_channels * cfg.patch**2 * cfg.dim * 2 + 2 * a * cfg.audio_dim * cfg.dim
    per_step_once = cfg.n_blocks * 2 * a * block.w_cross_kv.weight.numel() + 2 * a * cfg.audio_dim * cfg.dim
    return len(cfg.noise_levels) * (cfg.n_blocks * (gemm + attention) + replicated) + per_step_once
