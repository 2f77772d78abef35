"""The module body: ``DiT.forward`` over the ring in the model's dtype -- the CPU serving path, and every
batched step. Its self-attention is the DiT's own interface (``SelfAttention``: write K/V, attend),
over one session's ring (``RingSelfAttention``) or a batch's lanes of one ``KVPool``
(``LaneSelfAttention``). Under TP the block's all-reduce is ``w_out``'s forward hook (model/tp.py)."""

from __future__ import annotations

import torch

from charstream.kernels.ring_write import rope_table
from charstream.kernels.rope import rotate_complex
from charstream.model.cache import KVCache, KVPool
from charstream.model.dit import DiT, Modulation, SelfAttention
from charstream.model.sampler import sample
from charstream.model.step.inputs import StepInputs


class RingSelfAttention:
    """The self-attention of one frame (or the sink) through one session's ring: write K/V, attend in place."""

    def __init__(self, cache: KVCache, positions: torch.Tensor) -> None:
        self.cache, self.positions = cache, positions
        # RoPE of the queries and keys of every layer, built once per step (the ring write reads it
        # too); one complex multiply rotates a tensor.
        self.rotation = rope_table(positions, cache.freqs)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape  # (1, F, T, H, D)
        q, k, v = (t.reshape(-1, *shape[-2:]) for t in (q, k, v))
        self.cache.write(layer, k, v, self.positions, self.rotation)
        return self.cache.attend(layer, rotate_complex(q, self.rotation).to(q.dtype)).reshape(shape)


class LaneSelfAttention:
    """The self-attention of one frame in each session of a batch, lanes of one ``KVPool``: lanes, write
    pointers, positions and validity are read from device tensors, so a CUDA graph replays it."""

    def __init__(self, pool: KVPool, inputs: StepInputs) -> None:
        self.pool, self.lanes, self.slot = pool, inputs.lanes, inputs.slot
        b, t = inputs.positions.shape[:2]
        # per step, as RingSelfAttention: the RoPE tables of every frame and each lane's attention bias
        self.rotation = rope_table(inputs.positions.flatten(0, 1), pool.freqs).unflatten(0, (b, t))
        self.bias = pool.slot_bias(inputs.lanes)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape  # (B, 1, T, H, D)
        q, k, v = (t.flatten(1, 2) for t in (q, k, v))
        self.pool.write(layer, self.lanes, self.slot, k, v, self.rotation)
        q = rotate_complex(q, self.rotation).to(q.dtype)
        return self.pool.attend(layer, self.lanes, q, self.bias).reshape(shape)


class LevelModulations:
    """The adaLN of the sampler's fixed levels, computed once: the weights are fixed while it serves."""

    def __init__(self, model: DiT) -> None:
        dev = model.head.weight.device
        self.sigma = {s: torch.full((1, 1), s, device=dev) for s in model.cfg.noise_levels}
        self.modulation: dict[float, Modulation] = {s: model.modulation(self.sigma[s]) for s in model.cfg.noise_levels}


def module_body(model: DiT, levels: LevelModulations, inputs: StepInputs, attn: SelfAttention) -> None:
    """The sampler's passes of ``DiT.forward`` over ``attn``'s ring(s), one batch of ``inputs`` (one
    session's frame or one per lane), into ``inputs.latent``. Modulations broadcast over the batch."""
    cross_kv = model.cross_context(inputs.audio)

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        return model(x, levels.sigma[sigma], inputs.audio, attn, cross_kv, levels.modulation[sigma])

    inputs.latent.copy_(sample(velocity, inputs.noise, model.cfg.noise_levels))
