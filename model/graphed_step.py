"""The diffusion step of one TP rank on a GPU: fused kernels, FP8 GEMMs, static buffers, one CUDA graph.

``ShardStep(model, cache)`` computes what ``Generator.step`` computes (model/generator.py: 4 passes of
the parallel-block DiT over the KV ring, Euler updates, the last pass's K/V kept) with, per block-pass:

    adaln_quant     residual x += gate * out (previous block), LayerNorm, adaLN, FP8 rows   1 launch
    w_in            FP8 GEMM -> fused [q | k | v | cross-q | mlp-up] (bf16)                1 launch
    ring_write_prep QK-norms, RoPE(q) in place, RoPE(k) + FP8 + ring write of K and V,
                    cross-q norm in place, saturation count                               1 launch
    attention       q over sink + valid ring, result written over the spent v columns:
                    in place over the FP8 ring (Triton) while the window fills, then the
                    window dequantised into bf16 + PyTorch's cuDNN SDPA (faster here)      1-4 launches
    cross attention cross-q over the step's audio K/V, written over the cross-q columns    1 launch
    quantize_rows   GELU on the mlp columns + FP8 rows of [attn | cross | mlp]             1 launch
    w_out           FP8 GEMM (+ the TP all-reduce under tensor parallelism)               1 launch

so [attn | cross | mlp] is the fused buffer's tail and no concatenation is ever copied. One graph is
captured per attention mode; ``set_inputs`` picks the mode each step. The noise
levels are fixed, so each level's adaLN modulation is computed once at construction. Everything
that moves between steps -- the ring write pointer, the frame's time position, the ring validity,
the noise, the audio tokens -- lives in device tensors that the graph reads, so one capture replays
for every step of a session (the position reset's delta rotation runs outside, every R steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from charstream.kernels.adaln_quant import adaln_quant_triton
from charstream.kernels.quantize_rows import quantize_rows_triton
from charstream.kernels.ring_attention import ring_attention_gathered, ring_attention_triton
from charstream.kernels.ring_write import ring_write_prep_triton
from charstream.model.cache import KVCache
from charstream.model.dit import DiT
from charstream.model.fp8_linear import Fp8Linear
from charstream.model.rope import frame_positions
from charstream.model.sampler import seeded_noise

# The ring attention's launch options on an H200 (block shapes, pipelining, FP8 or fp16 products):
# the fastest correct entry of the bench's sweep (docs/gpu-notes.md); kernels/ring_attention.py's
# defaults are the same shapes.
ATTENTION_OPTIONS = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2, "qk_fp8": False}
# The gathered (cuDNN) attention once the window is full: faster on the H200 in run 3 (132.5 vs
# 149.9 ms per TP=3 step) with its GPU tests passing (docs/gpu-runs/2026-11-29-run3-*).
GATHERED_BY_DEFAULT = True


class ShardStep:
    def __init__(
        self,
        model: DiT,
        cache: KVCache,
        tp_group: dist.ProcessGroup | None = None,
        attention_options: dict | None = None,
        prefer_gathered: bool = GATHERED_BY_DEFAULT,
    ) -> None:
        cfg = model.cfg
        self.model, self.cache, self.cfg, self.tp_group = model, cache, cfg, tp_group
        self.attention_options = dict(ATTENTION_OPTIONS if attention_options is None else attention_options)
        dev = cache.k.device
        block = model.blocks[0]
        self.n_heads, self.head_dim = block.n_heads, block.head_dim
        self.hd = self.n_heads * self.head_dim
        self.w_in = [Fp8Linear.from_weight(b.w_in.weight) for b in model.blocks]
        self.w_out = [Fp8Linear.from_weight(b.w_out.weight) for b in model.blocks]
        self.norms = [(b.q_norm.weight, b.k_norm.weight, b.cross_q_norm.weight) for b in model.blocks]
        with torch.inference_mode():  # per level: every block's (shift, scale, gate), the final (shift, scale)
            self.mods, self.final_mods = model.level_modulations(torch.tensor(cfg.noise_levels, device=dev))
        dtype = model.head.weight.dtype
        t, a = cfg.tokens_per_step, cfg.n_audio_tokens
        # Inputs the graph reads (written before each replay) and its output.
        self.noise = torch.zeros(1, 1, cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=dev)
        self.audio = torch.zeros(1, 1, a, cfg.audio_dim, device=dev)
        self.positions = frame_positions(0, cfg.grid, a, dev)
        self.slot = torch.zeros((), dtype=torch.int64, device=dev)
        self.latent = torch.zeros_like(self.noise)
        self.x = torch.zeros(t, cfg.dim, dtype=dtype, device=dev)  # the residual stream
        self.ones = torch.ones(self.n_heads, device=dev)  # unit scales: the cross K/V are plain bf16
        self.no_ring = torch.zeros(0, dtype=torch.bool, device=dev)
        # The gathered attention (cuDNN over a dequantised window) once the window is full: ring
        # positions of its frames, and the per-layer scratch window it fills.
        self.prefer_gathered = prefer_gathered
        self.gathered = False  # the mode of the next run, set by set_inputs
        self.frame_order = torch.zeros(cfg.window_frames, dtype=torch.int32, device=dev)
        win = (self.n_heads, cache.sink_slots + cfg.window_frames * t, self.head_dim)
        self.window = (torch.empty(win, dtype=dtype, device=dev), torch.empty(win, dtype=dtype, device=dev))
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}

    # -- the step body: eager, or recorded once into the graph --------------------------------------

    def _block(self, layer: int, level: int, out: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
        cache, hd, shape = self.cache, self.hd, (-1, self.n_heads, self.head_dim)
        shift, scale, _ = self.mods[level, layer]
        hq = adaln_quant_triton(self.x, shift, scale, out, gate)
        fused = self.w_in[layer].forward_quantized(*hq, out_dtype=self.x.dtype)
        q, k, v, cq = (fused[:, i * hd : (i + 1) * hd].unflatten(-1, shape[1:]) for i in range(4))
        ring_write_prep_triton(
            q, k, v, cq, cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer],
            self.slot, self.positions, cache.freqs, self.norms[layer], cache.saturated,
        )
        if self.gathered:
            ring_attention_gathered(
                q, cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer],
                self.frame_order, cache.sink_slots, cache.tokens_per_frame, self.window, out=v,
            )
        else:
            ring_attention_triton(
                q, cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer],
                cache.ring_valid, cache.sink_slots, cache.tokens_per_frame, out=v, **self.attention_options,
            )
        ck, cv = self.cross_kv[layer]
        ring_attention_triton(cq, ck, cv, self.ones, self.ones, self.no_ring, ck.shape[1], 1, block_n=16, out=cq)
        oq = quantize_rows_triton(fused[:, 2 * hd :], act_from=2 * hd)
        result = self.w_out[layer].forward_quantized(*oq, out_dtype=self.x.dtype)
        if self.tp_group is not None:
            dist.all_reduce(result, group=self.tp_group)  # the block's one collective
        return result

    def _velocity(self, latent: torch.Tensor, level: int, audio_x: torch.Tensor) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        video = m.patch_embed(m.patchify(latent.to(self.x.dtype)))[0, 0]
        torch.cat([video, audio_x], dim=0, out=self.x)
        out = gate = None
        for layer in range(cfg.n_blocks):
            out = self._block(layer, level, out, gate)
            gate = self.mods[level, layer, 2]
        x = self.x + gate * out
        shift, scale = self.final_mods[level]
        h = m.final_norm(x[: cfg.video_tokens]) * (1 + scale) + shift
        return m.unpatchify(m.head(h)[None, None])

    def _body(self) -> None:
        m, levels = self.model, self.cfg.noise_levels
        audio = self.audio.to(self.x.dtype)
        audio_x = m.audio_embed(audio)[0, 0]
        # (1, 1, heads, A, head_dim) -> (heads, A, head_dim): the cross "cache" of this step
        self.cross_kv = [(k[0, 0].contiguous(), v[0, 0].contiguous()) for k, v in m.cross_context(audio)]
        latent = self.noise
        for level, (sigma, next_sigma) in enumerate(zip(levels, [*levels[1:], 0.0], strict=True)):
            latent = latent + (next_sigma - sigma) * self._velocity(latent, level, audio_x).float()
        self.latent.copy_(latent)

    # -- public ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Record the step body as CUDA graphs, one per attention mode (after warm-up runs on a side
        stream, as PyTorch asks).

        The warm-up runs write ring slots at the current pointer; those slots and the saturation
        count are restored afterwards, so capturing mid-session changes nothing."""
        cache, span = self.cache, slice(int(self.slot), int(self.slot) + self.cfg.tokens_per_step)
        saved = (cache.k[:, :, span].clone(), cache.v[:, :, span].clone(), cache.saturated.clone())
        mode = self.gathered
        for gathered in (False, True) if self.prefer_gathered else (False,):
            self.gathered = gathered
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    self._body()
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[gathered] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[gathered]):
                self._body()
        self.gathered = mode
        cache.k[:, :, span], cache.v[:, :, span] = saved[:2]
        cache.saturated.copy_(saved[2])

    @torch.inference_mode()
    def run(self, graphed: bool = True) -> torch.Tensor:
        """One step on the current inputs (noise, audio, positions, slot); returns the latent buffer."""
        if graphed:
            if not self.graphs:
                raise RuntimeError("run(graphed=True) before capture()")
            self.graphs[self.gathered].replay()
        else:
            self._body()
        return self.latent

    @torch.inference_mode()
    def set_inputs(self, audio_tokens: torch.Tensor, noise: torch.Tensor, time_position: int) -> None:
        """Load one step's inputs into the graph's buffers (the ring pointer comes from the cache, after
        its ``begin_frame``) and pick the attention mode: gathered once the whole window is valid."""
        cache = self.cache
        self.audio.copy_(audio_tokens.reshape(self.audio.shape))
        self.noise.copy_(noise.reshape(self.noise.shape))
        self.positions[:, 0].fill_(time_position)
        self.slot.fill_(cache.write_start)
        frame = cache.next_frame
        oldest = frame - self.cfg.window_frames + 1
        order = [pos for pos, f in enumerate(cache.slot_frame) if f is not None and oldest <= f <= frame]
        self.gathered = self.prefer_gathered and len(order) == self.cfg.window_frames
        if self.gathered:
            self.frame_order.copy_(torch.tensor(order, dtype=torch.int32))

    def step(self, audio_tokens: torch.Tensor, seed: int, graphed: bool = True) -> torch.Tensor:
        """``Generator.step`` on this path: the next latent frame (C, h, w), float32."""
        _, t = self.cache.begin_frame()
        self.set_inputs(audio_tokens, seeded_noise(self.noise.shape, seed), t)
        latent = self.run(graphed)[0, 0].clone()
        self.cache.end_frame()
        return latent
