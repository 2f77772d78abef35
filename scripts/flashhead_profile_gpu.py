"""Lab script (not shipped): where a FlashHead chunk's GPU time goes, against the GPU's own ceilings.

1. ``ceilings``: bf16 and FP8 GEMMs at 8192^3 and bf16 at the DiT's own shapes (Pro, 9,216 tokens);
2. ``convs``: the Wan VAE decoder's 3-D convs, one per distinct shape (cuDNN, channels-last, bf16,
   benchmark mode as served), each with how often a decode runs it: time and TFLOP/s;
3. ``dit``: one compiled Pro DiT pass, profiled (kernel time by kind: GEMM, attention, fused pointwise,
   other), then candidate changes timed against it, pass for pass alternating, with their relative
   difference from the served pass's velocity: ``qkv`` (one GEMM for self-attention's q, k and v),
   ``gelu`` (the FFN's GELU in its first GEMM's epilogue, cuBLASLt's tanh GELU), both;
4. ``decode``: one compiled Wan decode of 9 latents, profiled the same way;
5. ``lite``: Lite at a batch of 16 sessions (as its capacity runs): a compiled DiT pass, the LTX decode of
   5 latents and the re-encode of 9 motion frames, each profiled and timed;
6. ``conv_forms``: the decoder's slowest convs -- a 96-channel 3x3x3 conv at 512x512 and the 96 -> 3 head --
   as served against equal forms of the same arithmetic (``FORMS``), each timed and its difference from the
   served form given.

    python scripts/flashhead_profile_gpu.py --out DIR [--parts ceilings,convs,dit,decode] [--reps 10]

Prints a table per part, writes ``flashhead_profile_gpu.json`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from charstream.model.families.flashhead.config import LITE, PRO
from charstream.model.families.flashhead.dit import FlashHeadDiT, apply_rope
from charstream.model.families.flashhead.loader import random_checkpoint
from charstream.model.families.flashhead.vae_ltx import random_ltx_vae
from charstream.model.families.flashhead.vae_wan import CausalConv3d, random_wan_vae


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn`` over ``reps`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kind(name: str) -> str:
    n = name.lower()
    if "triton" in n:  # before the rest: inductor names its kernels after the ops they fuse
        return "fused pointwise (inductor)"
    if any(s in n for s in ("fmha", "flash", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("fprop", "conv", "implicit_convolve", "dgrad", "winograd")):
        return "conv"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")):
        return "gemm"
    return "other"


def profiled(fn, warmup: int = 2) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Kernel ms of one call of ``fn`` by kind, and the 12 largest kernels."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms = e.device_time / 1000 if hasattr(e, "device_time") else e.cuda_time / 1000
            by_kind[kind(e.name)] += ms
            by_name[e.name[:90]] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return dict(by_kind), top


def ceilings(reps: int) -> dict:
    out = {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, reps)
    out["bf16 8192^3"] = 2 * 8192**3 / ms / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    ms = timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), reps)
    out["fp8 8192^3"] = 2 * 8192**3 / ms / 1e9
    m = PRO.latents_per_chunk * PRO.tokens_per_latent
    for label, k, n in (("q/k/v/o 1536->1536", 1536, 1536), ("qkv 1536->4608", 1536, 4608),
                        ("ffn in 1536->8960", 1536, 8960), ("ffn out 8960->1536", 8960, 1536)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ms = timed(partial(F.linear, x, w, bias), reps)
        out[f"bf16 {m} x {label}"] = 2 * m * k * n / ms / 1e9
    return out


def conv_shapes(vae) -> list[tuple[CausalConv3d, tuple[int, ...]]]:
    """Each 3-D conv of the decoder with its padded input shape in one decode of 9 latents (hooks, meta)."""
    seen = []

    def hook(module, args, _out):  # the hook sees the conv's input before its causal padding
        b, c, t, h, w = args[0].shape
        seen.append((module, (b, c, t + getattr(module, "history", 0), h, w)))

    handles = [m.register_forward_hook(hook) for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d)]
    with torch.no_grad():
        vae.decode_chunk(torch.zeros(1, 16, PRO.latents_per_chunk, *PRO.latent_grid, device="cuda", dtype=torch.bfloat16))
    for h in handles:
        h.remove()
    return seen


def convs(reps: int) -> list[dict]:
    torch.backends.cudnn.benchmark = True
    vae = random_wan_vae(0, "cuda", torch.bfloat16)
    groups: dict[tuple, list] = {}
    for module, shape in conv_shapes(vae):
        key = (tuple(module.weight.shape), shape, module.stride)
        groups.setdefault(key, [module, 0])[1] += 1
    rows = []
    for (wshape, shape, _), (module, count) in groups.items():
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
        y = F.conv3d(x, module.weight, module.bias, module.stride, module.padding)
        flops = 2 * y.numel() * module.weight[0].numel()
        ms = timed(partial(F.conv3d, x, module.weight, module.bias, module.stride, module.padding), reps)
        rows.append({"weight": wshape, "input": shape, "count": count, "ms": ms, "tflops": flops / ms / 1e9,
                     "total_ms": ms * count, "total_tflop": flops * count / 1e12})
    return rows


def served_form(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 3x3x3 conv over ``x`` (already padded in time), channels-last, as the decoder runs it."""
    return F.conv3d(x, w, b, padding=(0, 1, 1))


def contiguous_form(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same conv in PyTorch's default layout (cuDNN may pick other kernels); the layout copies timed too."""
    return F.conv3d(x.contiguous(), w.contiguous(), b, padding=(0, 1, 1))


def folded_form(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same conv as a 2-D conv per frame over its 3 input frames stacked in channels (3C in): a wider K
    for the GEMM, the stack's copy timed too."""
    bsz, c, t_in, h, wd = x.shape
    t = t_in - 2
    stacked = torch.cat([x[:, :, k:k + t] for k in range(3)], dim=1)  # (B, 3C, T, H, W): taps in order
    frames = stacked.transpose(1, 2).reshape(bsz * t, 3 * c, h, wd).contiguous(memory_format=torch.channels_last)
    w2 = w.permute(0, 2, 1, 3, 4).reshape(w.shape[0], 3 * c, 3, 3).contiguous(memory_format=torch.channels_last)
    y = F.conv2d(frames, w2, b, padding=1)
    return y.reshape(bsz, t, w.shape[0], h, wd).transpose(1, 2)


def padded_form(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, to: int = 8) -> torch.Tensor:
    """A conv with few outputs (the head's 3) padded to ``to`` outputs of zero weight, then sliced."""
    n = w.shape[0]
    wp = torch.cat([w, w.new_zeros(to - n, *w.shape[1:])]).contiguous(memory_format=torch.channels_last_3d)
    return F.conv3d(x, wp, torch.cat([b, b.new_zeros(to - n)]), padding=(0, 1, 1))[:, :n]


FORMS = {"served": served_form, "contiguous": contiguous_form, "folded": folded_form, "padded": padded_form}


def conv_forms(reps: int, frames: int = 33, size: int = 512, device: str = "cuda",
               dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Each form of the 96-channel conv and of the 96 -> 3 head on one random input: ms and the relative
    difference from the served form (``device``/``dtype``: a CPU check of the forms at a small size)."""
    torch.backends.cudnn.benchmark = True
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, 96, frames + 2, size, size, device=device, dtype=dtype, generator=g)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    rows = []
    for label, out, forms in (("96 -> 96", 96, ("served", "contiguous", "folded")),
                              ("96 -> 3 head", 3, ("served", "contiguous", "folded", "padded"))):
        w = (torch.randn(out, 96, 3, 3, 3, device=device, dtype=dtype, generator=g) / 50).contiguous(
            memory_format=torch.channels_last_3d)
        b = torch.randn(out, device=device, dtype=dtype, generator=g) / 50
        with torch.no_grad():
            reference = served_form(x, w, b).float()
            for form in forms:
                fn = partial(FORMS[form], x, w, b)
                y = fn().float()
                rows.append({"conv": label, "form": form, "rel_from_served": ((y - reference).norm() / reference.norm()).item(),
                             "ms": timed(fn, reps) if device == "cuda" else None})
    return rows


def fused_qkv_forward(self, x, audio, time_mod, rope):
    """FlashHeadBlock.forward with self-attention's q, k, v as one GEMM and, with ``self.gelu_epilogue``, the
    FFN's GELU in its first GEMM."""
    shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = (self.modulation + time_mod).chunk(6, dim=1)
    a = self.self_attn
    h = self.norm_self(x) * (1 + scale) + shift
    if self.fuse_qkv:
        q, k, v = F.linear(h, a.qkv_weight, a.qkv_bias).chunk(3, dim=-1)
    else:
        q, k, v = a.to_q(h), a.to_k(h), a.to_v(h)
    q = apply_rope(a.q_norm(q).unflatten(-1, (a.n_heads, -1)), *rope)
    k = apply_rope(a.k_norm(k).unflatten(-1, (a.n_heads, -1)), *rope)
    v = v.unflatten(-1, (a.n_heads, -1))
    att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    x = x + a.to_out(att.transpose(1, 2).flatten(2)) * gate
    batch, frames = audio.shape[:2]
    per_frame = self.norm_cross(x).reshape(batch * frames, -1, x.shape[-1])
    x = x + self.cross_attn(per_frame, context=audio.flatten(0, 1)).reshape(x.shape)
    h = self.norm_ffn(x) * (1 + ffn_scale) + ffn_shift
    if self.gelu_epilogue:
        hidden = torch._addmm_activation(self.ffn_in.bias, h.flatten(0, 1), self.ffn_in.weight.t(), use_gelu=True)
        hidden = hidden.unflatten(0, h.shape[:2])
    else:
        hidden = F.gelu(self.ffn_in(h), approximate="tanh")
    return x + self.ffn_out(hidden) * ffn_gate


def variant(dit: FlashHeadDiT, qkv: bool, gelu: bool) -> FlashHeadDiT:
    for block in dit.blocks:
        a = block.self_attn
        if qkv and not hasattr(a, "qkv_weight"):
            a.qkv_weight = torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight])
            a.qkv_bias = torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias])
        block.fuse_qkv, block.gelu_epilogue = qkv, gelu
        block.forward = types.MethodType(fused_qkv_forward, block)
    return dit


def pass_inputs(cfg, seed: int = 1, batch: int = 1) -> tuple[torch.Tensor, ...]:
    t = cfg.latents_per_chunk
    g = torch.Generator("cuda").manual_seed(seed)
    shape = (batch, cfg.latent_channels, t, *cfg.latent_grid)
    noisy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    audio = torch.randn(batch, t, cfg.audio_tokens, cfg.dim, device="cuda", dtype=torch.bfloat16, generator=g)
    return noisy, ref, torch.full((batch,), 937.5, device="cuda"), audio


def random_dit(cfg) -> FlashHeadDiT:
    dit = FlashHeadDiT(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        dit.load_checkpoint_state({k: v.to(torch.bfloat16) for k, v in random_checkpoint(cfg, 0, "cuda").items()})
    return dit


def dit_part(reps: int, ab_blocks: int = 10) -> dict:
    """The served pass at full depth, profiled and timed; the candidates A/B at ``ab_blocks`` blocks (a third
    of the compile time; every block is the same work)."""
    # every instance compiles the same forward: past dynamo's default of 8 recompiles the rest would run eager
    torch._dynamo.config.recompile_limit = 64
    inputs = pass_inputs(PRO)
    served = torch.compile(random_dit(PRO), dynamic=False)
    result: dict = {}
    with torch.no_grad():
        result["served_kinds_ms"], result["served_top"] = profiled(partial(served, *inputs))
        result["served_pass_ms"] = timed(partial(served, *inputs), reps)
        result["served_pass_tflops"] = 38.844 / result["served_pass_ms"] * 1e3
        served = None  # its memory back before the A/B
        torch.cuda.empty_cache()
        cfg = PRO.with_(n_blocks=ab_blocks)
        base_dit = random_dit(cfg)
        fns = {"served": torch.compile(base_dit, dynamic=False)}
        base = fns["served"](*inputs).float()
        result["variants"] = {}
        for name, (qkv, gelu) in {"qkv": (True, False), "gelu": (False, True), "qkv+gelu": (True, True)}.items():
            fns[name] = torch.compile(variant(random_dit(cfg), qkv, gelu), dynamic=False)
            out = fns[name](*inputs).float()
            result["variants"][name] = {"rel_from_served": ((out - base).norm() / base.norm()).item()}
        times = defaultdict(list)
        for _ in range(reps):  # alternating, so a clock change falls on all of them alike
            for name, fn in fns.items():
                times[name].append(timed(partial(fn, *inputs), 1, warmup=1))
        result[f"pass_ms_{ab_blocks}_blocks"] = {name: statistics.median(v) for name, v in times.items()}
        for name, fn in fns.items():
            result["variants"].setdefault(name, {})["kinds_ms"] = profiled(partial(fn, *inputs))[0]
    return result


def decode_part(reps: int) -> dict:
    torch.backends.cudnn.benchmark = True
    vae = random_wan_vae(0, "cuda", torch.bfloat16)
    z = torch.randn(1, 16, PRO.latents_per_chunk, *PRO.latent_grid, device="cuda", dtype=torch.bfloat16)
    decode = torch.compile(vae.decode_chunk, dynamic=False)
    with torch.no_grad():
        kinds, top = profiled(lambda: decode(z))
        ms = timed(lambda: decode(z), reps)
    return {"decode_ms": ms, "kinds_ms": kinds, "top": top, "tflops": 70.53 / ms * 1e3}


def lite_part(reps: int, batch: int = 16) -> dict:
    torch.backends.cudnn.benchmark = True
    result: dict = {"batch": batch}
    inputs = pass_inputs(LITE, batch=batch)
    dit = torch.compile(random_dit(LITE), dynamic=False)
    vae = random_ltx_vae(0, "cuda", torch.bfloat16)
    z = torch.randn(batch, 128, LITE.latents_per_chunk, *LITE.latent_grid, device="cuda", dtype=torch.bfloat16)
    frames = torch.rand(batch, 3, LITE.motion_frames, LITE.height, LITE.width, device="cuda", dtype=torch.bfloat16) * 2 - 1
    noise = torch.randn(vae.latent_shape(frames.shape), device="cuda")
    parts = {"dit pass": (partial(dit, *inputs), 3.5575 * batch),
             "ltx decode": (partial(torch.compile(vae.decode_chunk, dynamic=False), z), 7.714 * batch),
             "ltx encode": (partial(torch.compile(vae.encode_motion, dynamic=False), frames, noise), 2.104 * batch)}
    with torch.no_grad():
        for name, (fn, tflop) in parts.items():
            kinds, top = profiled(fn)
            ms = timed(fn, reps)
            result[name] = {"ms": ms, "ms_per_session": ms / batch, "tflops": tflop / ms * 1e3, "kinds_ms": kinds,
                            "top": top}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="ceilings,convs,conv_forms,dit,decode,lite")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = {"ceilings": ceilings, "convs": convs, "dit": dit_part, "decode": decode_part, "lite": lite_part,
             "conv_forms": conv_forms}
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            report[name] = parts[name](args.reps)
        except Exception as e:  # one part failing keeps the others' figures
            report[name] = {"error": repr(e)}
        print(f"== {name} ({time.perf_counter() - start:.0f} s)", flush=True)
        print(json.dumps(report[name], indent=1, default=str), flush=True)
        (out / "flashhead_profile_gpu.json").write_text(json.dumps(report, indent=1, default=str))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
