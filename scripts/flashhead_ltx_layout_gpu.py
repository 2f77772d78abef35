"""Lab: SoulX-FlashHead Lite's LTX VAE decode of a chunk in PyTorch's default 3-D layout against channels-last.

The Wan VAE (Pro) runs its weights and activations channels-last; the LTX VAE (Lite) runs them in the default
NCDHW layout, which has not been measured against channels-last. This times the decode of one Lite chunk (5 latents -> 33
frames at 512x512, seeded random weights, bf16) per batch size, both layouts, each through ``torch.compile`` as
served, the relative difference between the two layouts' frames (they do the same math: only rounding may
differ) and each one's from an fp32 decode (default layout, TF32 off: the reference a served layout must stay
as close to as the other). Prints a table and writes ``flashhead_ltx_layout_gpu.json``.

    python scripts/flashhead_ltx_layout_gpu.py --out DIR [--batches 1,16] [--size 512] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from charstream.model.families.flashhead.config import LITE
from charstream.model.families.flashhead.vae_ltx import LATENT_CHANNELS, random_ltx_vae

# A CPU run only checks that the script works: float32 there (bf16 3-D convs on a CPU take minutes).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def channels_last(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        if p.ndim == 5:
            p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
    return module


def timed_ms(fn, warmup: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Median wall milliseconds of ``fn()`` (synchronised on a GPU), and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--size", type=int, default=LITE.height)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True  # as served (family.warm_up)
    layouts = {"default": random_ltx_vae(3, DEVICE, LOW), "channels_last": channels_last(random_ltx_vae(3, DEVICE, LOW))}
    exact = random_ltx_vae(3, DEVICE, torch.float32)
    side = args.size // 32
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        z = torch.randn(batch, LATENT_CHANNELS, LITE.latents_per_chunk, side, side,
                        generator=torch.Generator().manual_seed(batch)).to(DEVICE)
        frames = {}
        for name, vae in layouts.items():
            decode = vae.decode_chunk if args.no_compile else torch.compile(vae.decode_chunk, dynamic=False)
            inputs = z.contiguous(memory_format=torch.channels_last_3d) if name == "channels_last" else z
            with torch.no_grad():
                ms, frames[name] = timed_ms(lambda d=decode, x=inputs: d(x), 2, args.repeats)
            rows.append({"batch": batch, "layout": name, "ms": round(ms, 2), "ms_per_row": round(ms / batch, 2)})
            print(f"batch {batch:>3} {name:<14} {ms:9.2f} ms  {ms / batch:8.2f} ms a row", flush=True)
        a, b = frames["channels_last"].double(), frames["default"].double()
        rows[-1]["rel_to_default"] = float(((a - b).norm() / b.norm()).item())
        print(f"batch {batch:>3} channels_last vs default: {rows[-1]['rel_to_default']:.2e} relative", flush=True)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, benchmark=False, allow_tf32=False):
                reference = exact.decode_chunk(z).double()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        for row, name in zip(rows[-2:], layouts, strict=True):
            row["rel_to_fp32"] = float(((frames[name].double() - reference).norm() / reference.norm()).item())
            print(f"batch {batch:>3} {name:<14} vs fp32: {row['rel_to_fp32']:.2e} relative", flush=True)
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(LOW), "size": args.size, "compiled": not args.no_compile, "rows": rows}
    (args.out / "flashhead_ltx_layout_gpu.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
