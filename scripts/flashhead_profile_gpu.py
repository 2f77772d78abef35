"""Lab script (not shipped): where a FlashHead chunk's GPU time goes, against the GPU's own ceilings.

1. ``ceilings``: bf16 and FP8 GEMMs at 8192^3 and bf16 at the DiT's own shapes (Pro, 9,216 tokens);
2. ``convs``: the Wan VAE decoder's 3-D convs, one per distinct shape (cuDNN, channels-last, bf16,
   benchmark mode as served), each with how often a decode runs it: time and TFLOP/s;
3. ``dit``: one compiled Pro DiT pass, profiled (kernel time by kind: GEMM, attention, fused pointwise,
   other) and timed;
4. ``decode``: one compiled Wan decode of 9 latents, profiled the same way (rates: the family's FLOP count,
   ``ModelFamily.flops_per_chunk``);
5. ``lite``: Lite at a batch of 16 sessions (as its capacity runs): a compiled DiT pass, the LTX decode of
   5 latents and the re-encode of 9 motion frames, each profiled and timed;
6. ``conv_forms``: the decoder's slowest convs -- a 96-channel 3x3x3 conv at 512x512 and the 96 -> 3 head --
   as served against equal forms of the same arithmetic (``FORMS``), each timed and its difference from the
   served form given.

    python scripts/flashhead_profile_gpu.py --out DIR [--parts ceilings,convs,conv_forms,dit,decode,lite] [--reps 10]

Prints a table per part, writes ``flashhead_profile_gpu.json`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from charstream.model.families import get_family
from charstream.model.families.flashhead.config import LITE, PRO
from charstream.model.families.flashhead.dit import FlashHeadDiT
from charstream.model.families.flashhead.loader import random_checkpoint
from charstream.model.families.flashhead.vae_ltx import random_ltx_vae
from charstream.model.families.flashhead.vae_wan import CausalConv3d, random_wan_vae
from charstream.pipeline.bench.output import cuda_median_ms


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
    ms = cuda_median_ms(lambda: a @ b, reps)
    out["bf16 8192^3"] = 2 * 8192**3 / ms / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    ms = cuda_median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), reps)
    out["fp8 8192^3"] = 2 * 8192**3 / ms / 1e9
    m = PRO.latents_per_chunk * PRO.tokens_per_latent
    for label, k, n in (("q/k/v/o 1536->1536", 1536, 1536), ("qkv 1536->4608", 1536, 4608),
                        ("ffn in 1536->8960", 1536, 8960), ("ffn out 8960->1536", 8960, 1536)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ms = cuda_median_ms(partial(F.linear, x, w, bias), reps)
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
        ms = cuda_median_ms(partial(F.conv3d, x, module.weight, module.bias, module.stride, module.padding), reps)
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
                             "ms": cuda_median_ms(fn, reps) if device == "cuda" else None})
    return rows


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


def dit_part(reps: int) -> dict:
    """The served pass at full depth, profiled and timed."""
    inputs = pass_inputs(PRO)
    served = torch.compile(random_dit(PRO), dynamic=False)
    tflop = get_family(PRO.name).flops_per_chunk()["denoise"] / len(PRO.sigmas) / 1e12
    with torch.no_grad():
        kinds, top = profiled(partial(served, *inputs))
        ms = cuda_median_ms(partial(served, *inputs), reps)
    return {"pass_ms": ms, "tflops": tflop / ms * 1e3, "kinds_ms": kinds, "top": top}


def decode_part(reps: int) -> dict:
    torch.backends.cudnn.benchmark = True
    vae = random_wan_vae(0, "cuda", torch.bfloat16)
    z = torch.randn(1, 16, PRO.latents_per_chunk, *PRO.latent_grid, device="cuda", dtype=torch.bfloat16)
    decode = torch.compile(vae.decode_chunk, dynamic=False)
    with torch.no_grad():
        kinds, top = profiled(lambda: decode(z))
        ms = cuda_median_ms(lambda: decode(z), reps)
    tflop = get_family(PRO.name).flops_per_chunk()["decode"] / 1e12
    return {"decode_ms": ms, "kinds_ms": kinds, "top": top, "tflops": tflop / ms * 1e3}


def lite_part(reps: int, batch: int = 16) -> dict:
    torch.backends.cudnn.benchmark = True
    result: dict = {"batch": batch}
    inputs = pass_inputs(LITE, batch=batch)
    dit = torch.compile(random_dit(LITE), dynamic=False)
    vae = random_ltx_vae(0, "cuda", torch.bfloat16)
    z = torch.randn(batch, 128, LITE.latents_per_chunk, *LITE.latent_grid, device="cuda", dtype=torch.bfloat16)
    frames = torch.rand(batch, 3, LITE.motion_frames, LITE.height, LITE.width, device="cuda", dtype=torch.bfloat16) * 2 - 1
    noise = torch.randn(vae.latent_shape(frames.shape), device="cuda")
    flops = {part: batch * n / 1e12 for part, n in get_family(LITE.name).flops_per_chunk().items()}
    parts = {"dit pass": (partial(dit, *inputs), flops["denoise"] / len(LITE.sigmas)),
             "ltx decode": (partial(torch.compile(vae.decode_chunk, dynamic=False), z), flops["decode"]),
             "ltx encode": (partial(torch.compile(vae.encode_motion, dynamic=False), frames, noise), flops["motion_encode"])}
    with torch.no_grad():
        for name, (fn, tflop) in parts.items():
            kinds, top = profiled(fn)
            ms = cuda_median_ms(fn, reps)
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
