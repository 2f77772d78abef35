"""FlashHead's DiT: Wan2.1's text-to-video transformer, its text cross-attention turned into per-frame
audio cross-attention.

One forward denoises a whole chunk (9 latents for Pro, 5 for Lite) bidirectionally: no cache, RoPE
positions start at 0 in every chunk. Each block: adaLN-modulated self-attention (q/k RMSNorm across
all heads, 3-D RoPE), then cross-attention in which latent frame ``f``'s tokens attend only to frame
``f``'s 32 audio tokens (LayerNorm with affine before it, no gate after it), then an adaLN-modulated
GELU-tanh FFN. The head is modulated by the time embedding itself, not by the blocks' projection.

Module names are ours; ``checkpoint_key_map`` is the one map to the checkpoint's (original Wan2.1)
names, which ``FlashHeadDiT.load_checkpoint_state`` reads directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from charstream.model.families.flashhead.config import FlashHeadConfig


class RMSNorm(nn.Module):
    """RMS over the last dimension (all heads at once), computed in fp32, rounded, then scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def timestep_embedding(timestep: Tensor, dim: int) -> Tensor:
    """[cos | sin] of timestep x 10000^(-i / (dim/2)), in float64."""
    half = dim // 2
    exponents = torch.arange(half, dtype=torch.float64, device=timestep.device) / half
    angles = timestep.double()[:, None] * torch.pow(10000.0, -exponents)[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def round_to_bf16(x: Tensor) -> Tensor:
    """``x`` rounded to the nearest bf16 value (ties to even), as fp32. Integer arithmetic, not a cast down
    and back up: inductor elides such a cast pair inside a fused kernel on CUDA, and the rounding with it."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).view(torch.float32)


def rope_tables(split: tuple[int, int, int], grid: tuple[int, int, int], device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin (tokens, head_dim / 2) of the 3-D RoPE over a (frames, rows, columns) token grid,
    frame-major; each axis rotates its own channel pairs with theta 10,000."""
    angles = []
    for axis, (channels, size) in enumerate(zip(split, grid, strict=True)):
        inv = 1.0 / (10000.0 ** (torch.arange(0, channels, 2, dtype=torch.float64, device=device) / channels))
        table = torch.arange(size, dtype=torch.float64, device=device)[:, None] * inv[None]
        shape = [1, 1, 1, channels // 2]
        shape[axis] = size
        angles.append(table.view(shape).expand(*grid, channels // 2))
    full = torch.cat(angles, dim=-1).reshape(math.prod(grid), -1)
    return torch.cos(full).float(), torch.sin(full).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved channel pairs of x (batch, tokens, heads, head_dim) in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with q/k RMSNorm across heads; self-attention when ``context`` is None."""

    def __init__(self, dim: int, n_heads: int, eps: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(dim, eps)
        self.k_norm = RMSNorm(dim, eps)

    def forward(self, x: Tensor, context: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        source = x if context is None else context
        q = self.q_norm(self.to_q(x)).unflatten(-1, (self.n_heads, -1))
        k = self.k_norm(self.to_k(source)).unflatten(-1, (self.n_heads, -1))
        v = self.to_v(source).unflatten(-1, (self.n_heads, -1))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.to_out(out.transpose(1, 2).flatten(2))


class FlashHeadBlock(nn.Module):
    def __init__(self, cfg: FlashHeadConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.norm_self = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = Attention(d, cfg.n_heads, cfg.eps)
        self.norm_cross = nn.LayerNorm(d, eps=cfg.eps)
        self.cross_attn = Attention(d, cfg.n_heads, cfg.eps)
        self.norm_ffn = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.ffn_in = nn.Linear(d, cfg.ffn_dim)
        self.ffn_out = nn.Linear(cfg.ffn_dim, d)
        # per-block offsets of the shared time projection: shift, scale, gate (self), shift, scale, gate (FFN)
        self.modulation = nn.Parameter(torch.zeros(1, 6, d))

    def forward(self, x: Tensor, audio: Tensor, time_mod: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """x (batch, frames x tokens, d); audio (batch, frames, audio tokens, d); time_mod (batch, 6, d)."""
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = (self.modulation + time_mod).chunk(6, dim=1)
        x = x + self.self_attn(self.norm_self(x) * (1 + scale) + shift, rope=rope) * gate
        # each latent frame's tokens attend to that frame's audio tokens only
        batch, frames = audio.shape[:2]
        per_frame = self.norm_cross(x).reshape(batch * frames, -1, x.shape[-1])
        x = x + self.cross_attn(per_frame, context=audio.flatten(0, 1)).reshape(x.shape)
        hidden = F.gelu(self.ffn_in(self.norm_ffn(x) * (1 + ffn_scale) + ffn_shift), approximate="tanh")
        return x + self.ffn_out(hidden) * ffn_gate


class FlashHeadDiT(nn.Module):
    def __init__(self, cfg: FlashHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embed = nn.Conv3d(cfg.in_channels, d, kernel_size=cfg.patch, stride=cfg.patch)
        self.time_in = nn.Linear(cfg.freq_dim, d)
        self.time_out = nn.Linear(d, d)
        self.time_modulation = nn.Linear(d, 6 * d)
        self.blocks = nn.ModuleList(FlashHeadBlock(cfg) for _ in range(cfg.n_blocks))
        self.head_norm = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.head_modulation = nn.Parameter(torch.zeros(1, 2, d))  # shift, scale
        self.head_proj = nn.Linear(d, cfg.latent_channels * math.prod(cfg.patch))
        self._rope_cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def _rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[Tensor, Tensor]:
        key = (grid, device)
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(self.cfg.rope_split, grid, device)
        return self._rope_cache[key]

    def time_embedding(self, timestep: Tensor) -> tuple[Tensor, Tensor]:
        """The time embedding (batch, d) and the blocks' modulation (batch, 6, d) of ``timestep`` (batch,).

        The timestep is rounded to bf16 first: the released model ran in bf16 and cast its timestep to the
        activations' dtype, so it saw 1000/936/832/624 for the sampler's 1000/937.5/833.3/625 -- at fp32
        without the rounding the output moves ~13% (most of the bf16-vs-fp32 difference)."""
        rounded = round_to_bf16(timestep)
        dtype = self.time_in.weight.dtype
        emb = self.time_out(F.silu(self.time_in(timestep_embedding(rounded, self.cfg.freq_dim).to(dtype))))
        return emb, self.time_modulation(F.silu(emb)).unflatten(1, (6, -1))

    def forward(self, noisy: Tensor, reference: Tensor, timestep: Tensor, audio: Tensor) -> Tensor:
        """Flow velocity of a chunk.

        noisy, reference: (batch, latent channels, frames, h, w) latents (the reference image's latent
        repeated by the VAE over the chunk); timestep: (batch,) sigma x 1000; audio: (batch, frames,
        audio tokens, d) from the audio adapter. Returns (batch, latent channels, frames, h, w).
        """
        x = self.patch_embed(torch.cat([noisy, reference], dim=1))
        batch, _, frames, rows, cols = x.shape
        x = x.flatten(2).transpose(1, 2)
        emb, time_mod = self.time_embedding(timestep)
        rope = self._rope((frames, rows, cols), x.device)
        audio = audio.to(x.dtype)
        for block in self.blocks:
            x = block(x, audio, time_mod, rope)
        shift, scale = (self.head_modulation + emb[:, None]).chunk(2, dim=1)
        x = self.head_proj(self.head_norm(x) * (1 + scale) + shift)
        pt, ph, pw = self.cfg.patch
        x = x.reshape(batch, frames, rows, cols, pt, ph, pw, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(batch, -1, frames * pt, rows * ph, cols * pw)

    @torch.no_grad()
    def load_checkpoint_state(self, state: Mapping[str, Tensor]) -> None:
        """Copy the checkpoint's tensors (original Wan2.1 names) into this module, every one required."""
        params = dict(self.named_parameters())
        names = checkpoint_key_map(self.cfg.n_blocks)
        assert names.keys() == params.keys(), "the key map covers every parameter"
        for ours, theirs in names.items():  # one tensor at a time: ``state`` may read them from disk
            params[ours].copy_(state[theirs])


def checkpoint_key_map(n_blocks: int) -> dict[str, str]:
    """Our parameter names -> the checkpoint's, for every parameter of ``FlashHeadDiT``."""
    top = {
        "patch_embed": "patch_embedding",
        "time_in": "time_embedding.0",
        "time_out": "time_embedding.2",
        "time_modulation": "time_projection.1",
        "head_proj": "head.head",
    }
    attention = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out": "o", "q_norm": "norm_q", "k_norm": "norm_k"}
    block = {"norm_cross": "norm3", "ffn_in": "ffn.0", "ffn_out": "ffn.2"}
    keys = {"head_modulation": "head.modulation"}
    for ours, theirs in top.items():
        keys |= {f"{ours}.weight": f"{theirs}.weight", f"{ours}.bias": f"{theirs}.bias"}
    for i in range(n_blocks):
        keys[f"blocks.{i}.modulation"] = f"blocks.{i}.modulation"
        linears = dict(block)
        for attn in ("self_attn", "cross_attn"):
            linears |= {f"{attn}.{ours}": f"{attn}.{theirs}" for ours, theirs in attention.items()}
        for ours, theirs in linears.items():
            keys[f"blocks.{i}.{ours}.weight"] = f"blocks.{i}.{theirs}.weight"
            if not ours.endswith("_norm"):
                keys[f"blocks.{i}.{ours}.bias"] = f"blocks.{i}.{theirs}.bias"
    return keys
