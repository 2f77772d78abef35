"""Lab: SoulX-FlashHead Pro's VAE work per chunk on one GPU, ours beside diffusers' and the model's own code.

Times, at 512x512 in bf16 on seeded random weights written as ``Wan2.1_VAE.pth``: the decode of a 9-latent chunk
(33 frames), the encode of 5 motion frames (2 latents) and the LAB colour match of the 33 frames; the relative error
of each bf16 result against our float32 decode (TF32 off), and our float32 decode against diffusers' float32 one.
Prints a table last and writes ``flashhead_vae_gpu.json``.

    python scripts/flashhead_vae_gpu.py --out DIR [--reference-code DIR] [--size 512] [--no-compile]

``--reference-code`` is a folder holding the model's own ``flash_head/`` package (``wan/modules/vae.py``,
``utils/utils.py``), run as the baseline when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# A CPU run only checks that the script works: float32 there (bf16 3-D convs on a CPU take minutes).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float32
sys.path.insert(0, str(ROOT / "tests"))

from test_flashhead_vae_wan import random_wan_state  # noqa: E402 -- the tests' seeded weights, original key space

from charstream.model.families.flashhead.colour import colour_reference, match_colours  # noqa: E402
from charstream.model.families.flashhead.vae_wan import (  # noqa: E402
    LATENT_MEAN,
    LATENT_STD,
    Upsample,
    load_wan_vae,
)


def nearest_then_conv(self: Upsample, x: torch.Tensor) -> torch.Tensor:
    """The reference's spatial upsampling, literally: the variant the sub-pixel conv replaces."""
    return self.conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"))


def timed(fn, warmup: int, repeats: int) -> tuple[float, object]:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, the host clock on a CPU), and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():
            t = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times), out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm() / b.norm()).item())


def ceilings() -> dict[str, float]:
    """The two numbers measured here: bf16 matmul TFLOP/s on random data, device copy GB/s (read + write)."""
    n = 8192 if torch.cuda.is_available() else 256
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms, _ = timed(lambda: a @ b, 3, 10)
    src = torch.randn(n * n * 16, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms, _ = timed(lambda: dst.copy_(src), 3, 10)
    return {"matmul_tflops": 2 * n**3 / ms / 1e9, "copy_gbps": 2 * src.nbytes / copy_ms / 1e6}


def convs_not_channels_last(module: torch.nn.Module, fn) -> list[str]:
    """The convs of ``module`` whose output ``fn()`` leaves in a plain (not channels-last) layout: each is a copy."""
    found: list[str] = []
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: found.append(name) if not (
        o.is_contiguous(memory_format=torch.channels_last_3d if o.ndim == 5 else torch.channels_last)) else None)
        for name, m in module.named_modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Conv3d)]
    fn()
    for h in hooks:
        h.remove()
    return found


def conv_variants(size: int) -> list[dict[str, float]]:
    """The decoder's two dominant convs (3x3x3 causal, C -> C over 33 frames) three ways, bf16 channels-last:
    cuDNN's conv3d; one conv2d over the three time taps stacked as channels; three conv2d summed."""
    return [row for c, side in ((96, size), (192, size // 2)) for row in _conv_variants(c, side)]


def _conv_variants(c: int, side: int) -> list[dict[str, float]]:
    conv2d = torch.nn.functional.conv2d
    x = torch.randn(1, c, 35, side, side, device=DEVICE, dtype=LOW).contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(c, c, 3, 3, 3, device=DEVICE, dtype=LOW) / (27 * c) ** 0.5
    w3 = w.contiguous(memory_format=torch.channels_last_3d)
    frames = x.transpose(1, 2)[0]  # (35, C, H, W), channels-last 2-D view
    w_stacked = w.permute(0, 2, 1, 3, 4).flatten(1, 2).contiguous(memory_format=torch.channels_last)
    w_taps = [w[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(3)]

    def stacked() -> torch.Tensor:
        return conv2d(torch.cat([frames[0:33], frames[1:34], frames[2:35]], dim=1), w_stacked, padding=1)

    def summed() -> torch.Tensor:
        y = conv2d(frames[0:33], w_taps[0], padding=1)
        y += conv2d(frames[1:34], w_taps[1], padding=1)
        y += conv2d(frames[2:35], w_taps[2], padding=1)
        return y

    reference = torch.nn.functional.conv3d(x, w3, padding=(0, 1, 1))[0].transpose(0, 1)
    flops = 2 * 27 * c * c * 33 * side * side
    rows = []
    for name, fn in (("conv3d", lambda: torch.nn.functional.conv3d(x, w3, padding=(0, 1, 1))),
                     ("conv2d stacked taps", stacked), ("3 conv2d summed", summed)):
        ms, y = timed(fn, 3, 10)
        err = rel(y if y.ndim == 4 else y[0].transpose(0, 1), reference)
        rows.append({"channels": c, "side": side, "variant": name, "ms": ms, "tflops": flops / ms / 1e9, "rel": err})
        print(f"conv {c}ch {side}x{side}x33 {name}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s, rel {err:.1e}",
              flush=True)
    return rows


def conv_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference-code", type=Path)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--skip-baselines", action="store_true",
                        help="ours only (eager and compiled): no ceilings, FLOP count, diffusers or model's code")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=150, help="start no compile after this many seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.allow_tf32 = False  # the float32 reference is float32; bf16 runs are unaffected
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_grad_enabled(False)
    t0 = time.time()
    results: dict[str, object] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                                  "size": args.size}
    if not args.skip_baselines:
        results["ceilings"] = ceilings()
    rows: list[tuple[str, float, float | None]] = []

    def save() -> None:
        results["rows"] = [{"what": w, "ms": ms, "rel_err": e} for w, ms, e in rows]
        (args.out / "flashhead_vae_gpu.json").write_text(json.dumps(results, indent=2))

    def add(what: str, ms: float, err: float | None) -> None:
        rows.append((what, ms, err))
        print(f"[{time.time() - t0:6.1f} s] {what}: {ms:.2f} ms, rel err {err}", flush=True)
        save()

    path = Path("/tmp/VAE_Wan/Wan2.1_VAE.pth")
    path.parent.mkdir(exist_ok=True)
    state = random_wan_state(0)
    torch.save(state, path)
    h = args.size // 8
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    latents = torch.randn(1, 16, 9, h, h, device=DEVICE, generator=gen)
    motion = torch.rand(1, 3, 5, args.size, args.size, device=DEVICE, generator=gen) * 2 - 1
    image = torch.rand(1, 3, 1, args.size, args.size, device=DEVICE, generator=gen) * 2 - 1
    mean = torch.tensor(LATENT_MEAN, device=DEVICE).view(1, 16, 1, 1, 1)
    std = torch.tensor(LATENT_STD, device=DEVICE).view(1, 16, 1, 1, 1)

    # The float32 reference runs on cuDNN's heuristics: benchmarking its algorithms at these sizes takes minutes.
    ours32 = load_wan_vae(path, DEVICE, torch.float32)
    ref_frames = ours32.decode_chunk(latents)
    ref_latents = ours32.encode_motion(motion)
    torch.backends.cudnn.benchmark = True
    if not args.skip_baselines:
        results["decode_flops"] = conv_flops(lambda: ours32.decode_chunk(latents))
        results["encode_flops"] = conv_flops(lambda: ours32.encode_motion(motion))
        from diffusers import AutoencoderKLWan
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        with torch.device("meta"):
            diff = AutoencoderKLWan()
        diff.load_state_dict(convert_wan_vae_to_diffusers(state), strict=True, assign=True)
        diff = diff.eval().to(DEVICE)
        results["ours_fp32_vs_diffusers_fp32_decode"] = rel(ref_frames, diff.decode(latents * std + mean).sample)
        results["ours_fp32_vs_diffusers_fp32_encode"] = rel(
            ref_latents, (diff.encode(motion).latent_dist.mode() - mean) / std)
        diff = diff.to(LOW)
    del state

    ours = load_wan_vae(path, DEVICE, LOW)
    lat16, motion16 = latents.to(LOW), motion.to(LOW)
    ms, out = timed(lambda: ours.decode_chunk(lat16), 2, args.repeats)
    add("decode 9 latents, ours eager", ms, rel(out, ref_frames))
    results["decoder_conv_outputs_not_channels_last"] = convs_not_channels_last(ours.decoder, lambda: ours.decode_chunk(lat16))
    ms, out = timed(lambda: ours.encode_motion(motion16), 2, args.repeats)
    add("encode 5 frames, ours eager", ms, rel(out, ref_latents))
    reference = colour_reference(image)
    frames16 = ref_frames.to(LOW)
    ms, ours_matched = timed(lambda: match_colours(frames16, reference), 2, 20)
    matched32 = match_colours(ref_frames, reference)
    add("colour match 33 frames, ours", ms, rel(ours_matched, matched32))

    if not args.skip_baselines:
        sub_pixel, Upsample._spatial = Upsample._spatial, nearest_then_conv
        ms, out = timed(lambda: ours.decode_chunk(lat16), 2, args.repeats)
        add("decode 9 latents, ours eager, nearest+conv", ms, rel(out, ref_frames))
        Upsample._spatial = sub_pixel
        ms, out = timed(lambda: diff.decode((lat16 * std + mean).to(LOW)).sample, 1, args.repeats)
        add("decode 9 latents, diffusers", ms, rel(out, ref_frames))
        ms, out = timed(lambda: (diff.encode(motion16).latent_dist.mode() - mean) / std, 1, args.repeats)
        add("encode 5 frames, diffusers", ms, rel(out, ref_latents))

    if args.reference_code and not args.skip_baselines:
        sys.path.insert(0, str(args.reference_code))
        sys.modules.setdefault("pyloudnorm", types.ModuleType("pyloudnorm"))  # imported there, unused here
        from flash_head.utils.utils import match_and_blend_colors_torch
        from flash_head.wan.modules.vae import WanVAE

        theirs = WanVAE(vae_path=str(path), dtype=LOW, device=DEVICE)
        ms, out = timed(lambda: theirs.decode(lat16[0]), 1, args.repeats)
        add("decode 9 latents, model's code eager", ms, rel(out, ref_frames))
        ms, out = timed(lambda: theirs.encode(motion16), 1, args.repeats)
        add("encode 5 frames, model's code eager", ms, rel(out, ref_latents[0]))
        ms, out = timed(lambda: match_and_blend_colors_torch(frames16, image.to(LOW), 1.0), 2, 20)
        add("colour match 33 frames, model's code", ms, rel(out, matched32))
        results["model_colour_fp32_vs_ours_fp32"] = rel(match_and_blend_colors_torch(ref_frames, image, 1.0),
                                                        matched32)

    results["conv_variants"] = conv_variants(args.size)
    save()
    if not args.no_compile and time.time() - t0 < args.deadline_s:
        t = time.time()
        decode = torch.compile(ours.decode_chunk, dynamic=False)
        decode(lat16)
        results["compile_decode_s"] = time.time() - t
        ms, out = timed(lambda: decode(lat16), 2, args.repeats)
        add("decode 9 latents, ours compiled", ms, rel(out, ref_frames))
    if not args.no_compile and time.time() - t0 < args.deadline_s:
        match = torch.compile(match_colours, dynamic=False)
        ms, out = timed(lambda: match(frames16, reference), 2, 20)
        add("colour match 33 frames, ours compiled", ms, rel(out, matched32))
    if not args.no_compile and time.time() - t0 < args.deadline_s:
        t = time.time()
        encode = torch.compile(ours.encode_motion, dynamic=False)
        encode(motion16)
        results["compile_encode_s"] = time.time() - t
        ms, out = timed(lambda: encode(motion16), 2, args.repeats)
        add("encode 5 frames, ours compiled", ms, rel(out, ref_latents))

    results["wall_s"] = time.time() - t0
    save()
    print(f"\n{results['device']}, torch {results['torch']}, {args.size}x{args.size} bf16")
    if "ceilings" in results:
        c = results["ceilings"]
        floor_ms = results["decode_flops"] / (c["matmul_tflops"] * 1e9)
        print(f"matmul {c['matmul_tflops']:.0f} TFLOP/s, copy {c['copy_gbps']:.0f} GB/s; decode "
              f"{results['decode_flops'] / 1e12:.1f} TFLOP (floor {floor_ms:.0f} ms at the matmul rate), encode "
              f"{results['encode_flops'] / 1e12:.2f} TFLOP; ours fp32 vs diffusers fp32: decode "
              f"{results['ours_fp32_vs_diffusers_fp32_decode']:.1e}, encode "
              f"{results['ours_fp32_vs_diffusers_fp32_encode']:.1e}")
    print(f"{'what':45s} {'ms':>9s} {'rel err vs fp32':>16s}")
    for what, ms, err in rows:
        print(f"{what:45s} {ms:9.2f} {'' if err is None else f'{err:.2e}':>16s}")


if __name__ == "__main__":
    main()
