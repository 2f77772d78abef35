"""The fused body: one pass of the DiT as FP8 GEMMs and fused kernels through the kernels' entry points,
per block-pass

    adaln_quant     residual x += gate * out (previous block), LayerNorm, adaLN, FP8 rows   1 launch
    w_in            FP8 GEMM -> fused [q | k | v | cross-q | mlp-up]                       1 launch
    attention       the backend's (model/step/attention.py): the ring-write prep (QK-norms,
                    RoPE, FP8 ring write, cross-q norm; one launch) and the self-attention,
                    in place over the ring into the spent v columns, or into cuDNN's own
                    buffer over the layer's window                                       2-3 launches
    cross attention cross-q over the step's audio K/V, written over the cross-q columns    1 launch
    quantize_rows   GELU on the mlp columns + FP8 rows of [attn | cross | mlp], the attn
                    columns read from the backend's buffer when it has one (no copy)       1 launch
    w_out           FP8 GEMM, then the block's one all-reduce under TP                     1-2 launches

so [attn | cross | mlp] is the fused buffer's tail and nothing is concatenated. Once per step, before the
passes, every block's audio K/V come from one FP8 GEMM (``FusedCrossContext``). On CUDA it runs eagerly
or as one CUDA graph per attention backend, the all-reduces inside the graph (NCCL collectives are
capturable); on CPU it runs eagerly on the kernels' PyTorch references, which is how the CPU tests
check its collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from charstream.kernels.adaln_quant import adaln_quant
from charstream.kernels.cross_attention import cross_attention
from charstream.kernels.quantize_rows import quantize_rows
from charstream.kernels.ring_write import rope_table
from charstream.model.dit import DiT
from charstream.model.fp8_linear import Fp8Linear, quantize_weight
from charstream.model.sampler import sample
from charstream.model.step.attention import StepAttention
from charstream.model.step.inputs import StepInputs


class FusedCrossContext:
    """Every block's cross-attention K/V of one step, from the audio context (A, dim), in one FP8 GEMM
    over all blocks' ``w_cross_kv`` and one RMS norm of all their keys (``cross_k_norm``), as the module
    body's ``ParallelBlock.cross_context`` computes them block by block: one block's K/V is a (heads, A,
    head_dim) view of the one output, no copy. Block by block, each is a bf16 GEMM of 9 rows over its whole
    weight, the norm's passes and two copies: a few launches a block (docs/decisions/0008-cross-kv-one-gemm.md)."""

    def __init__(self, model: DiT) -> None:
        blocks = model.blocks
        weights, scales = zip(*(quantize_weight(b.w_cross_kv.weight) for b in blocks), strict=True)
        self.kv = Fp8Linear(torch.cat(weights), torch.cat(scales))  # rows: block, [k | v], head, head_dim
        self.k_norm = torch.stack([b.cross_k_norm.weight.detach() for b in blocks])[:, None]  # (blocks, 1, head_dim)
        self.eps = blocks[0].cross_k_norm.eps
        self.shape = (len(blocks), 2, blocks[0].n_heads, blocks[0].head_dim)

    def __call__(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context (A, dim) -> per block (k, v), each (heads, A, head_dim) with the strides of the one output."""
        kv = self.kv(context).unflatten(-1, self.shape)  # (A, blocks, 2, heads, head_dim)
        k = kv[:, :, 0]
        k.copy_(F.rms_norm(k.float(), k.shape[-1:], eps=self.eps).to(k.dtype) * self.k_norm)
        return [(kv[:, i, 0].transpose(0, 1), kv[:, i, 1].transpose(0, 1)) for i in range(self.shape[0])]


class FusedBody:
    """The fused body of one rank's step over its cache, on ``inputs`` (a batch of one), attending through
    ``attention`` (the step sets it before each run)."""

    def __init__(self, model: DiT, inputs: StepInputs, tp_group: dist.ProcessGroup | None,
                 attention: StepAttention) -> None:
        cfg, dev = model.cfg, model.head.weight.device
        self.model, self.cfg, self.inputs, self.tp_group, self.attention = model, cfg, inputs, tp_group, attention
        block = model.blocks[0]
        self.shape = (block.n_heads, block.head_dim)
        self.hd = block.n_heads * block.head_dim
        self.w_in = [Fp8Linear.from_weight(b.w_in.weight) for b in model.blocks]
        self.w_out = [Fp8Linear.from_weight(b.w_out.weight) for b in model.blocks]
        self.cross_context = FusedCrossContext(model)
        with torch.inference_mode():  # per level: every block's (shift, scale, gate), the final (shift, scale)
            self.mods, self.final_mods = model.level_modulations(torch.tensor(cfg.noise_levels, device=dev))
        self.level_index = {sigma: i for i, sigma in enumerate(cfg.noise_levels)}
        self.x = torch.zeros(cfg.tokens_per_step, cfg.dim, dtype=model.head.weight.dtype, device=dev)  # the residual stream

    def __call__(self) -> None:
        """One run: the sampler's passes over the inputs, into ``inputs.latent``."""
        m, inputs = self.model, self.inputs
        audio = inputs.audio.to(self.x.dtype)
        audio_x = m.audio_embed(audio)[0, 0]
        cross_kv = self.cross_context(m.audio_context(audio)[0, 0])  # per block (heads, A, head_dim): the cross "cache"
        rotation = rope_table(inputs.positions[0], self.attention.cache.freqs)  # every layer's and pass's RoPE, once

        def velocity(latent: torch.Tensor, sigma: float) -> torch.Tensor:
            return self._pass(latent, self.level_index[sigma], audio_x, cross_kv, rotation)

        inputs.latent.copy_(sample(velocity, inputs.noise, self.cfg.noise_levels))

    def _pass(self, latent: torch.Tensor, level: int, audio_x: torch.Tensor, cross_kv: list,
              rotation: torch.Tensor) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        video = m.patch_embed(m.patchify(latent.to(self.x.dtype)))[0, 0]
        torch.cat([video, audio_x], dim=0, out=self.x)
        out = gate = None
        for layer in range(cfg.n_blocks):
            out = self._block(layer, level, out, gate, cross_kv[layer], rotation)
            gate = self.mods[level, layer, 2]
        x = self.x + gate * out
        shift, scale = self.final_mods[level]
        h = m.final_norm(x[: cfg.video_tokens]) * (1 + scale) + shift
        return m.unpatchify(m.head(h)[None, None])

    def _block(self, layer: int, level: int, out: torch.Tensor | None, gate: torch.Tensor | None,
               cross: tuple[torch.Tensor, torch.Tensor], rotation: torch.Tensor) -> torch.Tensor:
        hd = self.hd
        shift, scale, _ = self.mods[level, layer]
        hq = adaln_quant(self.x, shift, scale, out, gate)
        fused = self.w_in[layer].forward_quantized(*hq, out_dtype=self.x.dtype)
        q, k, v, cq = (fused[:, i * hd : (i + 1) * hd].unflatten(-1, self.shape) for i in range(4))
        attn, attn_scale = self.attention.forward(layer, q, k, v, cq, rotation)
        ck, cv = cross  # the step's audio K/V of this block, each (heads, audio tokens, head_dim)
        cross_attention(cq, ck, cv, cq)
        oq = quantize_rows(fused[:, 2 * hd :], act_from=2 * hd, prefix=attn, prefix_scale=attn_scale)
        result = self.w_out[layer].forward_quantized(*oq, out_dtype=self.x.dtype)
        if self.tp_group is not None:
            dist.all_reduce(result, group=self.tp_group)  # the block's one collective
        return result
