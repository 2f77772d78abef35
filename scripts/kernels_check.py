"""The diffusion step's kernels on one GPU: each variant checked against its PyTorch
reference on fresh random inputs (outputs poisoned first), then timed at the TP=3 shard's shapes of
``characters-57b`` (20 heads x 128, 757 tokens per frame, sink + 10 ring frames, 7 of them valid).

Timing: per call inside one CUDA graph of many calls rotating over several layers' caches (as
``bench gpu`` times kernels), median of the replays. Prints a table last; ``--json`` writes every
figure. Usage: ``python3 scripts/kernels_check.py --json kernels.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
import traceback
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from charstream.kernels.adaln_quant import adaln_quant_reference, adaln_quant_triton
from charstream.kernels.delta_rotate import delta_rotate_reference, delta_rotate_triton
from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX
from charstream.kernels.quantize_rows import quantize_rows_reference, quantize_rows_triton
from charstream.kernels.ring_attention import (
    gather_window,
    ring_attention_reference,
    ring_attention_triton,
    window_attention,
)
from charstream.kernels.ring_write import (
    ring_write_prep_reference,
    ring_write_prep_triton,
    ring_write_reference,
    ring_write_triton,
    rope_table,
)
from charstream.kernels.rope import rope_freqs
from charstream.model.rope import frame_positions
from charstream.pipeline.bench.gpu import _graph_ms, _graphs_ms, prep_without_ring_write

H, D, T, GRID, AUDIO = 20, 128, 757, (22, 34), 9
SINK, RING, VALID = T, 10, 7
N_SLOTS = SINK + RING * T
LAYERS = 8  # rotated over: 8 x 43 MB of K/V, several times the 60 MB L2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@contextlib.contextmanager
def _variant(result: dict[str, object], section: str, name: str) -> Iterator[dict[str, object]]:
    """One variant's entry, filled by the with-block: an exception there becomes its ``error`` (the
    section's other variants still run); then it is stored as ``result[name]`` and printed."""
    entry: dict[str, object] = {}
    try:
        yield entry
    except Exception as exc:
        traceback.print_exc()
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    result[name] = entry
    print(f"[check] {section} {name}: {entry}", flush=True)


def _fp8_mismatch(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Fraction of FP8 values differing, and whether any differs by more than one e4m3 step."""
    g, r = got.float(), ref.float()
    step = 0.125 * torch.maximum(g.abs(), r.abs()) + 2.0**-9
    return {"differ": (g != r).float().mean().item(), "beyond_one_step": int(((g - r).abs() > step).sum()),
            "nan": int(torch.isnan(g).sum())}


def _fp8_cache(layers: int, gen: torch.Generator, n_slots: int = N_SLOTS) -> torch.Tensor:
    t = torch.empty(layers, H, n_slots, D, dtype=FP8_DTYPE, device="cuda")
    for i in range(layers):
        t[i] = (torch.randn(H, n_slots, D, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    return t


ATTENTION_VARIANTS = {  # name: ring_attention_triton options (defaults: m128 n128 w8 s4, one program per SM)
    "m128_n128_w8_s4": {},
    "m128_n128_w8_s3": {"num_stages": 3},
    "m64_n128_w4_s2": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2},
}


def _attend(q, args, opts, i, out):
    return ring_attention_triton(q, *args(i), out=out, **opts)


def attention(gen: torch.Generator) -> dict[str, object]:
    k, v = _fp8_cache(LAYERS, gen), _fp8_cache(LAYERS, gen)
    ks = torch.rand(LAYERS, H, device="cuda", generator=gen) * 0.015 + 0.005
    vs = torch.rand(LAYERS, H, device="cuda", generator=gen) * 0.015 + 0.005
    ring_valid = torch.zeros(RING, dtype=torch.bool, device="cuda")
    order = torch.tensor([3, 4, 5, 6, 7, 8, 9], dtype=torch.int32, device="cuda")  # 7 valid frames, in ring order
    ring_valid[order.long()] = True
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    args = lambda i: (k[i], v[i], ks[i], vs[i], ring_valid, SINK, T)  # noqa: E731
    ref = ring_attention_reference(q, *args(0)).float()
    # the bf16 path's reference: dequantized K/V rounded to bf16, cuDNN/flash SDPA (what gathered runs)
    window = tuple(torch.empty(H, SINK + VALID * T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
    attended = SINK + VALID * T
    flops = 4 * T * attended * D * H
    result: dict[str, object] = {"flops_per_call": flops, "attended_keys": attended,
                                 "bytes_per_call": 2 * H * attended * D + 2 * T * H * D * 2}
    variants: dict[str, object] = {
        "gathered_cudnn": lambda i, o: window_attention(q, *gather_window(k[i], v[i], ks[i], vs[i], order, SINK, T, window), o),
    }
    for name, opts in ATTENTION_VARIANTS.items():
        variants[f"streamk_{name}"] = functools.partial(_attend, q, args, opts)
    # a partly valid ring (frames 0, 2, 5 only) checks the in-kernel frame listing once per variant
    sparse = torch.zeros(RING, dtype=torch.bool, device="cuda")
    sparse[[0, 2, 5]] = True
    ref_sparse = ring_attention_reference(q, k[1], v[1], ks[1], vs[1], sparse, SINK, T).float()
    for name, fn in variants.items():
        with _variant(result, "attention", name) as entry:
            buf = torch.full((T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            got = fn(0, buf).float()
            entry["rel_error_vs_fp32"] = _rel(got, ref)
            entry["nan"] = int(torch.isnan(got).sum())
            if name.startswith("streamk"):
                buf.fill_(float("nan"))
                fn_sparse = variants[name]
                saved = ring_valid.clone()
                ring_valid.copy_(sparse)
                try:
                    got_sparse = fn_sparse(1, buf).float()
                finally:
                    ring_valid.copy_(saved)
                entry["rel_error_sparse_ring"] = _rel(got_sparse, ref_sparse)
            entry["ms"] = _graph_ms([functools.partial(fn, i % LAYERS, out) for i in range(4 * LAYERS)])
            entry["tflops"] = flops / entry["ms"] / 1e9
    return result


RING_WRITE_VARIANTS = ((8, 4, 4, False), (8, 4, 4, True), (16, 1, 4, False), (8, 2, 4, True), (8, 4, 8, False))


def ring_write(gen: torch.Generator) -> dict[str, object]:
    """The contract write and the block's prep (with the window copy, as the full-window step runs
    it), both reading one RoPE table; variants (tokens, heads, warps, prefetch)."""
    freqs = rope_freqs(D, "cuda")
    k_cache, v_cache = _fp8_cache(LAYERS, gen), _fp8_cache(LAYERS, gen)
    ks = torch.rand(LAYERS, H, device="cuda", generator=gen) * 0.02 + 0.01
    vs = torch.rand(LAYERS, H, device="cuda", generator=gen) * 0.02 + 0.01
    fused = torch.randn(T, 4 * H * D, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    _, kn, vn, _ = (fused[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
    positions = frame_positions(17, GRID, AUDIO, "cuda")
    rotation = rope_table(positions, freqs)
    slot_at = SINK + 6 * T
    slot = torch.tensor(slot_at, device="cuda")
    n_win = SINK + VALID * T
    windows = [torch.empty(LAYERS, H, n_win, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    win_slot = torch.tensor(SINK + 3 * T, device="cuda")
    norms = tuple(torch.rand(D, device="cuda", generator=gen) + 0.5 for _ in range(3))
    saturated = torch.zeros((), dtype=torch.int64, device="cuda")
    result: dict[str, object] = {"bytes_per_call": T * H * D * (2 * 2 + 2),
                                 "prep_bytes_per_call": T * H * D * (4 * 2 + 2 * 2 + 2 + 2 * 2)}
    ref = [torch.full((H, N_SLOTS, D), 300.0, device="cuda").to(FP8_DTYPE) for _ in range(2)]
    ring_write_reference(*ref, ks[0], vs[0], kn, vn, slot_at, positions, freqs)
    prep_ref = [fused.clone(), *(torch.full((H, N_SLOTS, D), 300.0, device="cuda").to(FP8_DTYPE) for _ in range(2)),
                torch.zeros((), dtype=torch.int64, device="cuda")]
    pq, pk, pv, pcq = (prep_ref[0][:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
    ring_write_prep_reference(pq, pk, pv, pcq, prep_ref[1], prep_ref[2], ks[0], vs[0], slot_at, positions, freqs, norms,
                              prep_ref[3])
    result["rope_table_us"] = _graph_ms([functools.partial(rope_table, positions, freqs)]) * 1e3
    for bt, heads, w, prefetch in RING_WRITE_VARIANTS:
        name = f"t{bt}_h{heads}_w{w}{'_prefetch' if prefetch else ''}"
        launch = {"block_t": bt, "heads": heads, "num_warps": w, "prefetch": prefetch}
        with _variant(result, "ring_write", name) as entry:
            got = [torch.full((H, N_SLOTS, D), 300.0, device="cuda").to(FP8_DTYPE) for _ in range(2)]
            ring_write_triton(*got, ks[0], vs[0], kn, vn, slot, positions, freqs, rotation, **launch)
            entry["k"], entry["v"] = _fp8_mismatch(got[0], ref[0]), _fp8_mismatch(got[1], ref[1])
            entry["ms"] = _graph_ms([functools.partial(
                ring_write_triton, k_cache[i % LAYERS], v_cache[i % LAYERS], ks[i % LAYERS], vs[i % LAYERS], kn, vn, slot,
                positions, freqs, rotation, **launch) for i in range(240)])
            (gq, gk, gv, gcq), got, win, sat = _prep_buffers(fused, n_win)
            ring_write_prep_triton(gq, gk, gv, gcq, *got, ks[0], vs[0], slot, positions, freqs, norms, sat,
                                   rotation=rotation, window=(*win, win_slot), **launch)
            written = slice(SINK + 3 * T, SINK + 4 * T)
            window_exact = all(torch.equal(w_[:, written], (c[:, slot_at : slot_at + T].float() * s_[:, None, None]).to(torch.bfloat16))
                               for w_, c, s_ in zip(win, got, (ks[0], vs[0]), strict=True))
            entry["prep"] = {"q_rel": _rel(gq, pq), "cq_rel": _rel(gcq, pcq), "k": _fp8_mismatch(got[0], prep_ref[1]),
                             "v": _fp8_mismatch(got[1], prep_ref[2]), "saturated": int(sat), "saturated_ref": int(prep_ref[3]),
                             "window_exact": window_exact,
                             "window_others_untouched": bool(all(torch.isnan(w_[:, : SINK + 3 * T]).all() for w_ in win))}
            scratch = fused.clone()  # the prep rewrites q and cq in place: time it on a copy
            tq, tk, tv, tcq = (scratch[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
            entry["prep_ms"] = _graph_ms([functools.partial(
                ring_write_prep_triton, tq, tk, tv, tcq, k_cache[i % LAYERS], v_cache[i % LAYERS], ks[i % LAYERS],
                vs[i % LAYERS], slot, positions, freqs, norms, saturated, rotation=rotation,
                window=(windows[0][i % LAYERS], windows[1][i % LAYERS], win_slot), **launch) for i in range(240)])
    result["as_served"] = _prep_parts(fused, k_cache, v_cache, ks, vs, slot, positions, freqs, rotation, norms, windows,
                                      win_slot, result["rope_table_us"])
    return result


def _prep_buffers(fused: torch.Tensor, n_win: int) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor],
                                                             list[torch.Tensor], torch.Tensor]:
    """A copy of the fused q/k/v/cq buffer as its four (tokens, H, D) views, a poisoned FP8 K/V ring, a NaN
    bf16 window pair and a zeroed saturation counter: what one checked prep call writes into."""
    buf = fused.clone()
    views = tuple(buf[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
    ring = [torch.full((H, N_SLOTS, D), 300.0, device="cuda").to(FP8_DTYPE) for _ in range(2)]
    window = [torch.full((H, n_win, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    return views, ring, window, torch.zeros((), dtype=torch.int64, device="cuda")


def _prep_parts(fused, k_cache, v_cache, ks, vs, slot, positions, freqs, rotation, norms, windows, win_slot,
                rope_table_us) -> dict[str, object]:
    """The serving prep (its default launch) without its FP8 ring stores, without its window copy, and
    without both, against itself, timed in turns: what the ring write adds to the prep is its cost as
    served. Checked first: without the ring stores the ring keeps its poison, q, cq and the window are
    bit-equal to the full prep's."""
    with _variant({}, "ring_write", "as_served") as entry:
        n_win, slot_at = windows[0].shape[2], int(slot)
        runs = []
        for write_ring in (True, False):
            (gq, gk, gv, gcq), ring, win, sat = _prep_buffers(fused, n_win)
            prep = ring_write_prep_triton if write_ring else prep_without_ring_write
            prep(gq, gk, gv, gcq, *ring, ks[0], vs[0], slot, positions, freqs, norms, sat,
                 rotation=rotation, window=(*win, win_slot))
            runs.append((gq, gcq, *win, sat, ring))
        full, bare = runs
        poison = torch.tensor(300.0).to(FP8_DTYPE).float().item()
        entry["no_ring_write_check"] = {
            "ring_left_poisoned": bool(all((r.float() == poison).all() for r in bare[5])),
            "ring_written_by_full": bool(all((r[:, slot_at : slot_at + T].float() != poison).any() for r in full[5])),
            # the window's unwritten slots hold the NaN poison: equal as NaN
            "q_cq_window_equal": bool(all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                                          for a, b in zip(full[:4], bare[:4], strict=True))),
            "saturated_equal": int(full[4]) == int(bare[4]),
        }
        scratch = fused.clone()
        tq, tk, tv, tcq = (scratch[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
        saturated = torch.zeros((), dtype=torch.int64, device="cuda")

        def call(i: int, write_ring: bool, window: bool) -> None:
            layer = i % LAYERS
            prep = ring_write_prep_triton if write_ring else prep_without_ring_write
            prep(tq, tk, tv, tcq, k_cache[layer], v_cache[layer], ks[layer], vs[layer], slot, positions,
                 freqs, norms, saturated, rotation=rotation,
                 window=(windows[0][layer], windows[1][layer], win_slot) if window else None)

        parts = {"served": (True, True), "no_ring_write": (False, True), "no_window_copy": (True, False),
                 "neither": (False, False)}
        ms = _graphs_ms({name: [functools.partial(call, i, *kw) for i in range(240)] for name, kw in parts.items()})
        entry["prep_us"] = {name: v * 1e3 for name, v in ms.items()}
        entry["ring_write_marginal_us"] = (ms["served"] - ms["no_ring_write"]) * 1e3
        entry["window_copy_marginal_us"] = (ms["served"] - ms["no_window_copy"]) * 1e3
        # the GPU part of cache upkeep per step as served (begin_frame's host time and the rotation: bench gpu)
        entry["ring_writes_as_served_plus_rope_table_ms_per_step"] = (240 * entry["ring_write_marginal_us"] + rope_table_us) / 1e3
    return entry


def window_attn(gen: torch.Generator) -> dict[str, object]:
    """cuDNN SDPA over a full bf16 window (what the full-window step runs per call), its queries the
    (tokens, heads) columns of the fused projection: passed as the strided view they are
    (``window_attention``), or copied into a contiguous (heads, tokens) buffer first."""
    n_win = SINK + VALID * T
    k_win, v_win = (torch.randn(LAYERS, H, n_win, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    fused = torch.randn(T, 4 * H * D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = fused[:, : H * D].unflatten(-1, (H, D))
    out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k_win[0].float()[None], v_win[0].float()[None])
    ref = ref[0].transpose(0, 1)
    result: dict[str, object] = {}
    variants = (("strided_q", lambda i, o: window_attention(q, k_win[i], v_win[i], o)),
                ("copy_q", lambda i, o: window_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k_win[i], v_win[i], o)))
    for name, fn in variants:
        with _variant(result, "window_attn", name) as entry:
            buf = torch.full((T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            entry["rel_vs_fp32"] = _rel(fn(0, buf), ref)
            entry["ms"] = _graph_ms([functools.partial(fn, i % LAYERS, out) for i in range(4 * LAYERS)])
    result["fp8_cudnn"] = _window_attn_fp8(q, k_win, v_win, ref)
    return result


def _window_attn_fp8(q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, ref: torch.Tensor) -> dict[str, object]:
    """cuDNN's FP8 SDPA over the same windows stored as the cache stores them (e4m3 codes, per-head
    scales): the K scales folded into the queries before their e4m3 quantization (one scalar scale
    per layer, here from the measured amax; the step's from a bound), the output in V's code units at
    scale 1 (the step's 0.5 leaves room for the probabilities' rounding) times V's per-head scales after.
    Errors: against fp32 math over the same codes (the kernel), and end to end against the fp32
    reference over the bf16 window (what ``strided_q`` is compared with). Timed: the cuDNN call alone,
    and with the two elementwise passes a step would add around it if the prep and the GELU rows
    did not do them (q's quantization, the output's per-head rescale)."""
    from charstream.kernels.fp8_window_attention import Fp8WindowAttention, fp8_window_attention_reference

    with _variant({}, "window_attn", "fp8_cudnn") as entry:
        k_scale = k_win.float().abs().amax(dim=(2, 3)) / FP8_MAX  # (layers, heads)
        v_scale = v_win.float().abs().amax(dim=(2, 3)) / FP8_MAX
        k8 = (k_win.float() / k_scale[..., None, None]).to(FP8_DTYPE)
        v8 = (v_win.float() / v_scale[..., None, None]).to(FP8_DTYPE)
        folded = q.float() * k_scale[0][None, :, None]
        descale_q = (folded.abs().amax() / FP8_MAX).reshape(1)
        q8 = (folded / descale_q).to(FP8_DTYPE)
        one = torch.ones(1, device="cuda")
        t0 = time.perf_counter()
        attn = Fp8WindowAttention(H, T, k_win.shape[2], D, q8.stride(), 1.0 / D**0.5)
        entry["build_s"] = time.perf_counter() - t0
        entry["workspace_bytes"] = attn.workspace.numel()
        out8 = torch.full((T, H, D), float("nan"), device="cuda").to(FP8_DTYPE)
        attn(q8, k8[0], v8[0], descale_q, one, one, one, out8)
        got = out8.float()
        entry["nan"] = int(torch.isnan(got).sum())
        kernel_ref = fp8_window_attention_reference(q8, k8[0], v8[0], descale_q, one, one, 1.0 / D**0.5)
        entry["rel_vs_fp32_over_codes"] = _rel(got, kernel_ref)
        entry["rel_vs_fp32"] = _rel(got * v_scale[0][None, :, None], ref)
        out = torch.empty(T, H, D, device="cuda").to(FP8_DTYPE)
        real = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)

        def call(i: int) -> None:
            attn(q8, k8[i], v8[i], descale_q, one, one, one, out)

        q8_passes = torch.empty_like(q8)  # its own buffer: q8 stays the codes the checks below ran on

        def with_passes(i: int) -> None:
            q8_passes.copy_(q.float().mul(k_scale[i][None, :, None]).div(descale_q))
            attn(q8_passes, k8[i], v8[i], descale_q, one, one, one, out)
            torch.mul(out.float(), v_scale[i][None, :, None], out=real)

        ms = _graphs_ms({"alone": [functools.partial(call, i % LAYERS) for i in range(4 * LAYERS)],
                         "with_q_and_out_passes": [functools.partial(with_passes, i % LAYERS) for i in range(4 * LAYERS)]})
        entry["ms"] = ms["alone"]
        entry["ms_with_q_and_out_passes"] = ms["with_q_and_out_passes"]
        # cuDNN's amax results: each written one is a memset node per call in a graph (the step's profile)
        plans = {}
        for amax in (("s", "o"), ("o",), ()):
            name = "amax_" + ("".join(amax) or "none")
            try:
                plans[name] = Fp8WindowAttention(H, T, k_win.shape[2], D, q8.stride(), 1.0 / D**0.5, amax_outputs=amax)
                probe = torch.full((T, H, D), float("nan"), device="cuda").to(FP8_DTYPE)
                plans[name](q8, k8[0], v8[0], descale_q, one, one, one, probe)
                entry[f"{name}_equal_to_default"] = torch.equal(probe.view(torch.uint8), out8.view(torch.uint8))
            except Exception as exc:
                entry[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        timed = _graphs_ms({name: [functools.partial(plan, q8, k8[i % LAYERS], v8[i % LAYERS], descale_q, one, one, one, out)
                                   for i in range(4 * LAYERS)] for name, plan in plans.items()})
        entry.update({f"{name}_ms": v for name, v in timed.items()})
    return entry


def window_attn_split(gen: torch.Generator) -> dict[str, object]:
    """cuDNN's FP8 SDPA over the window's keys in K partitions, as the step serves it
    (``Fp8WindowAttention(splits=K)``: one call, the partitions a batch, q read through a batch stride
    of 0), then ``merge_partials`` of the K outputs by their statistics into bf16 columns of a wider
    buffer, at heads 20 (TP=3) and 15 (TP=4), K = 1, 2, 4, 8. Checked: each partition's output against
    fp32 math over its keys' codes, its statistics against their log-sum-exp, and the merge against fp32
    math over the whole window. Timed per call: the attention alone, and attention + merge. Also
    every execution plan cuDNN offers for K = 1 (``plan_<i>_ms``), timed in turns with the default."""
    from charstream.kernels.fp8_window_attention import choose_window_splits

    n_win = SINK + VALID * T
    windows = [_fp8_cache(LAYERS, gen, n_win) for _ in range(2)]
    q8 = (torch.randn(T, H, D, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict[str, object] = {}
    for heads in (H, 15):
        q = q8[:, :heads]  # the step's q codes are (T, heads, D) rows of a contiguous buffer, so is this view
        k8, v8 = (w[:, :heads].contiguous() for w in windows)
        head_scale = torch.rand(heads, device="cuda", generator=gen) * 0.02 + 0.01
        result[f"h{heads}_chosen_splits"] = choose_window_splits(heads, T, n_win, sms)
        for k in (1, 2, 4, 8):
            with _variant(result, "window_attn_split", f"h{heads}_k{k}") as entry:
                entry.update(_window_split(q, k8, v8, k, head_scale))
    return result


def _window_split(q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, k: int, head_scale: torch.Tensor) -> dict:
    from charstream.kernels.attention_merge import merge_partials
    from charstream.kernels.fp8_window_attention import (
        Fp8WindowAttention,
        fp8_window_attention_reference,
        fp8_window_partials_reference,
    )

    entry: dict[str, object] = {}
    heads, n_win, scale = q.shape[1], k8.shape[2], 1.0 / D**0.5
    descale = torch.full((1,), 1.0 / 64, device="cuda")
    one = torch.ones(1, device="cuda")
    full = fp8_window_attention_reference(q, k8[0], v8[0], descale, descale, one, scale)
    attn = Fp8WindowAttention(heads, T, n_win, D, q.stride(), scale, splits=k)
    entry["plans"] = attn.plan_count
    shape = (k, T, heads, D) if k > 1 else (T, heads, D)
    out = torch.full(shape, float("nan"), device="cuda").to(FP8_DTYPE)
    lse = torch.full((k, heads, T), float("nan"), device="cuda") if k > 1 else None
    attn(q, k8[0], v8[0], descale, descale, one, one, out, lse)
    entry["nan"] = int(torch.isnan(out.float()).sum())
    wide = torch.full((T, 5 * heads * D), float("nan"), device="cuda", dtype=torch.bfloat16)
    dest = wide[:, 2 * heads * D : 3 * heads * D].unflatten(-1, (heads, D))
    if k == 1:
        entry["rel_vs_fp32_over_codes"] = _rel(out.float(), full)
    else:
        parts, lses = fp8_window_partials_reference(q, k8[0], v8[0], descale, descale, one, scale, k)
        entry["rel_vs_fp32_over_codes"] = _rel(out.float(), parts)
        entry["lse_max_abs_error"] = (lse - lses).abs().max().item()
        merge_partials(out, lse, head_scale, dest)
        entry["merged_rel_vs_fp32"] = _rel(dest.float(), full * head_scale[None, :, None])
        entry["merge_outside_untouched"] = bool(torch.isnan(wide[:, : 2 * heads * D]).all()
                                                and torch.isnan(wide[:, 3 * heads * D :]).all())

    def call(i: int, merge: bool) -> None:
        attn(q, k8[i], v8[i], descale, descale, one, one, out, lse)
        if merge:
            merge_partials(out, lse, head_scale, dest)

    variants = {"ms": [functools.partial(call, i % LAYERS, False) for i in range(4 * LAYERS)]}
    if k > 1:
        variants["ms_with_merge"] = [functools.partial(call, i % LAYERS, True) for i in range(4 * LAYERS)]
    else:  # every plan cuDNN offers, in turns with the heuristics' choice
        for index in range(attn.plan_count):
            try:
                plan = Fp8WindowAttention(heads, T, n_win, D, q.stride(), scale, plan=index)
                probe = torch.full(shape, float("nan"), device="cuda").to(FP8_DTYPE)
                plan(q, k8[0], v8[0], descale, descale, one, one, probe)
            except Exception as exc:
                entry[f"plan_{index}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            entry[f"plan_{index}_rel_vs_fp32_over_codes"] = _rel(probe.float(), full)
            variants[f"plan_{index}_ms"] = [functools.partial(plan, q, k8[i % LAYERS], v8[i % LAYERS], descale, descale,
                                                              one, one, out) for i in range(4 * LAYERS)]
    entry.update(_graphs_ms(variants))
    return entry


def cross_attn(gen: torch.Generator) -> dict[str, object]:
    """The cross-attention over the step's 9 audio keys in place over the cross-q columns: the kernel the
    step serves (``kernels/cross_attention.py``) and the ring kernel's sink-only form it replaced
    (64-query tiles, 4 warps)."""
    from charstream.kernels.cross_attention import cross_attention_reference, cross_attention_triton

    audio = 9
    ck, cv = (torch.randn(H, audio, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    fused = torch.randn(T, 4 * H * D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cq = fused[:, 3 * H * D :].unflatten(-1, (H, D))
    ref = cross_attention_reference(cq, ck, cv, torch.empty(T, H, D, device="cuda"))
    result: dict[str, object] = {}
    with _variant(result, "cross_attn", "served") as entry:
        buf = torch.full((T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        entry["rel_vs_fp32"] = _rel(cross_attention_triton(cq, ck, cv, buf), ref)
        scratch = fused.clone()[:, 3 * H * D :].unflatten(-1, (H, D))
        entry["ms"] = _graph_ms([functools.partial(cross_attention_triton, scratch, ck, cv, scratch)] * 240)
    with _variant(result, "cross_attn", "ring_kernel_m64_w4") as entry:
        ones = torch.ones(H, device="cuda")
        no_ring = torch.zeros(0, dtype=torch.bool, device="cuda")
        buf = torch.full((T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = ring_attention_triton(cq, ck, cv, ones, ones, no_ring, audio, 1, block_m=64, block_n=16, num_warps=4,
                                    out=buf)
        entry["rel_vs_fp32"] = _rel(got, ref)
        scratch = fused.clone()[:, 3 * H * D :].unflatten(-1, (H, D))
        entry["ms"] = _graph_ms([functools.partial(ring_attention_triton, scratch, ck, cv, ones, ones, no_ring, audio, 1,
                                                   block_m=64, block_n=16, num_warps=4, out=scratch)] * 240)
    return result


ADALN_VARIANTS = ((1, 32), (1, 16), (1, 8), (1, 4), (2, 16), (2, 32))  # (rows per program, warps); the first is served


def adaln(gen: torch.Generator) -> dict[str, object]:
    """Residual update + LayerNorm + adaLN + FP8 rows at the block input's shape (757 x 7680), each
    call another layer's modulation (as in the step), the residual stream updated in place. Timed
    over LAYERS streams and residuals in turn (``ms``: 8 x 23 MB, beyond L2, as the step's passes
    find them) and over one pair (``ms_l2``: what stays in L2)."""
    dim = 7680
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    res = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    mods = torch.randn(60, 3, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.2
    x_ref = x.clone()
    adaln_quant_reference(x_ref, mods[0, 0], mods[0, 1], res, mods[0, 2])
    rq, rscale = adaln_quant_reference(x_ref.clone(), mods[0, 0], mods[0, 1])  # codes of the stream as stored
    streams = [torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)]
    residuals = [torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)]
    hq = torch.empty(T, dim, device="cuda", dtype=FP8_DTYPE)
    hs = torch.empty(T, 1, device="cuda")
    result: dict[str, object] = {"bytes_per_call": T * dim * (2 + 2 + 2 + 1)}
    for rows, w in ADALN_VARIANTS:
        name = f"rows{rows}_w{w}"
        with _variant(result, "adaln", name) as entry:
            xg = x.clone()
            out = (torch.full((T, dim), 300.0, device="cuda").to(FP8_DTYPE), torch.full((T, 1), float("nan"), device="cuda"))
            adaln_quant_triton(xg, mods[0, 0], mods[0, 1], res, mods[0, 2], out, rows=rows, num_warps=w)
            entry["check"] = _fp8_mismatch(out[0], rq)
            entry["scale_rel"] = _rel(out[1], rscale)
            entry["x_rel"] = _rel(xg, x_ref)
            call = functools.partial(adaln_quant_triton, rows=rows, num_warps=w)
            entry["ms"] = _graph_ms([functools.partial(call, streams[i % LAYERS], mods[i % 60, 0], mods[i % 60, 1],
                                                       residuals[i % LAYERS], mods[i % 60, 2], (hq, hs)) for i in range(240)])
            entry["ms_l2"] = _graph_ms([functools.partial(call, xg, mods[i % 60, 0], mods[i % 60, 1], res, mods[i % 60, 2],
                                                          (hq, hs)) for i in range(240)])
    return result


def rotation(gen: torch.Generator) -> dict[str, object]:
    freqs = rope_freqs(D, "cuda")
    small = (torch.randn(4, H, N_SLOTS, D, device="cuda", generator=gen) * 60).clamp(-448, 448).to(FP8_DTYPE)
    k_scale = torch.rand(60, H, device="cuda", generator=gen) * 0.02 + 0.01
    ref = small.clone()
    delta_rotate_reference(ref, k_scale[:4], 42, freqs.t, SINK)
    full = _fp8_cache(60, gen)  # the whole shard's K: 60 layers
    delta = torch.tensor(-1, device="cuda")
    result: dict[str, object] = {"cache_gb": full.numel() / 1e9}
    skip = (SINK + 6 * T, T)  # the frame about to be overwritten (as KVCache.begin_frame skips it)
    for bs, w, skipped in ((128, 4, None), (128, 4, skip), (256, 8, skip)):
        name = f"s{bs}_w{w}{'_skip' if skipped else ''}"
        with _variant(result, "rotation", name) as entry:
            got = small.clone()
            delta_rotate_triton(got, k_scale[:4], torch.tensor(42, device="cuda"), freqs.t, SINK, block_s=bs, num_warps=w)
            entry["check"] = _fp8_mismatch(got, ref)  # the check rotates everything; the timing skips as served
            entry["sink_or_hw_changed"] = int((got[:, :, :SINK].float() != small[:, :, :SINK].float()).sum()
                                              + (got[..., 44:].float() != small[..., 44:].float()).sum())
            import triton.testing

            entry["ms"] = float(triton.testing.do_bench(functools.partial(
                delta_rotate_triton, full, k_scale, delta, freqs.t, SINK, skipped, block_s=bs, num_warps=w), warmup=25, rep=200,
                return_mode="median"))
    return result


def gelu_rows(gen: torch.Generator) -> dict[str, object]:
    """GELU + FP8 rows of [attn | cross | mlp]: the attention columns in the fused buffer (where the
    in-place ring attention writes them), or read from the attention's own (T, heads x D) buffer
    (``prefix``: cuDNN's output, as the full-window step serves, x's attention columns poisoned with NaN
    so a read of them shows), each column loaded through its own pointer (served) or both buffers loaded
    and the values selected (``_select``); beside them, the copy of that buffer into the fused columns it replaces."""
    hd, ffn = H * D, 10240
    fused = torch.randn(T, 4 * hd + ffn, device="cuda", dtype=torch.bfloat16, generator=gen)
    fused *= torch.rand(T, 1, device="cuda", generator=gen).to(torch.bfloat16) * 10
    x = fused[:, 2 * hd :]
    attn = x[:, :hd].clone()
    rq, rscale = quantize_rows_reference(x, 2 * hd)
    poisoned = x.clone()
    poisoned[:, :hd] = float("nan")
    result: dict[str, object] = {"bytes_per_call": x.numel() * 3}
    # the FP8 window's attention output (served with it): e4m3 codes in V's units, a scale per head
    attn8 = (attn.float() * 40).clamp(-448, 448).to(FP8_DTYPE)
    head_scale = torch.rand(H, device="cuda", generator=gen) * 0.05 + 0.01
    rq8, rscale8 = quantize_rows_reference(x, 2 * hd, attn8, head_scale)
    variants = (("w8", x, None, {}, (rq, rscale)), ("w8_prefix_pointers", poisoned, attn, {}, (rq, rscale)),
                ("w8_prefix_select", poisoned, attn, {"prefix_select": True}, (rq, rscale)),
                ("w8_fp8_prefix", poisoned, attn8, {"prefix_scale": head_scale}, (rq8, rscale8)))
    # beyond L2, as the step finds its rows (the GEMM's output, evicted by the attention's window since):
    # LAYERS copies of the rows and of the prefix, rotated
    rows_far = [poisoned.clone() for _ in range(LAYERS)]
    for name, rows, prefix, opts, (ref_q, ref_scale) in variants:
        with _variant(result, "gelu_rows", name) as entry:
            xq = torch.full_like(ref_q, 300.0)
            sc = torch.full_like(ref_scale, float("nan"))
            quantize_rows_triton(rows, 2 * hd, (xq, sc), num_warps=8, prefix=prefix, **opts)
            entry["check"] = _fp8_mismatch(xq, ref_q)
            entry["scale_rel"] = _rel(sc, ref_scale)
            call = functools.partial(quantize_rows_triton, rows, 2 * hd, (xq, sc), num_warps=8, prefix=prefix, **opts)
            entry["ms_l2"] = _graph_ms([call] * 240)
            far = [x.clone() for _ in range(LAYERS)] if prefix is None else rows_far
            prefixes = [None] * LAYERS if prefix is None else [prefix.clone() for _ in range(LAYERS)]
            entry["ms"] = _graph_ms([functools.partial(quantize_rows_triton, far[i % LAYERS], 2 * hd, (xq, sc), num_warps=8,
                                                       prefix=prefixes[i % LAYERS], **opts) for i in range(240)])
    # what the prefix replaces: cuDNN's (T, heads, D) output copied over the fused buffer's v columns
    out = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cols = fused[:, 2 * hd : 3 * hd].unflatten(-1, (H, D))
    result["attention_output_copy"] = {"ms": _graph_ms([functools.partial(v_cols.copy_, out)] * 240)}
    print(f"[check] gelu_rows attention_output_copy: {result['attention_output_copy']}", flush=True)
    return result


def _table(results: dict) -> str:
    rows = [("kernel / variant", "ms per call", "check")]
    att = results.get("attention", {})
    for name, e in att.items():
        if isinstance(e, dict):
            rows.append((f"attention {name}", f"{e['ms']:.4f} ({e['tflops']:.0f} TF/s)" if "ms" in e else e.get("error", "")[:40],
                         f"rel {e.get('rel_error_vs_fp32', float('nan')):.2e} sparse {e.get('rel_error_sparse_ring', float('nan')):.2e}"))
    served = results.get("ring_write", {}).get("as_served", {})
    if "prep_us" in served:
        p = served["prep_us"]
        rows.append(("ring_write as served: prep / no ring write / no window copy / neither",
                     " / ".join(f"{p[n]:.2f}" for n in ("served", "no_ring_write", "no_window_copy", "neither")) + " us",
                     json.dumps(served.get("no_ring_write_check", {}))[:110]))
        contract = results["ring_write"].get("t8_h4_w4_prefetch", {}).get("ms", float("nan")) * 1e3
        rows.append(("  ring write: marginal in the prep / contract launch (us per call)",
                     f"{served['ring_write_marginal_us']:.2f} / {contract:.2f}",
                     f"x240 + RoPE table: {served['ring_writes_as_served_plus_rope_table_ms_per_step']:.3f} / "
                     f"{(240 * contract + results['ring_write']['rope_table_us']) / 1e3:.3f} ms per step"))
        rows.append(("  window copy: marginal in the prep (us per call)", f"{served['window_copy_marginal_us']:.2f}", ""))
    for section in ("ring_write", "adaln", "window_attn", "window_attn_split", "cross_attn", "rotation", "gelu_rows"):
        for name, e in results.get(section, {}).items():
            if isinstance(e, dict) and name != "as_served":
                ms = f"{e['ms'] * 1e3:.2f} us" if "ms" in e else e.get("error", "")[:40]
                if "prep_ms" in e:
                    ms += f" (prep {e['prep_ms'] * 1e3:.2f} us)"
                if "ms_with_merge" in e:
                    ms += f" (with merge {e['ms_with_merge'] * 1e3:.2f} us)"
                check = {k: e[k] for k in ("k", "v", "check") if k in e}
                rows.append((f"{section} {name}", ms, json.dumps(check)[:110]))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="*", default=["attention", "ring_write", "adaln", "window_attn", "cross_attn",
                                                         "rotation", "gelu_rows"])
    args = parser.parse_args()
    import triton

    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs
    results: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "triton": triton.__version__, "commit": os.environ.get("CHARSTREAM_COMMIT", "unknown")}
    for name in args.only:
        t0 = time.perf_counter()
        try:
            results[name] = globals()[name](gen)
        except Exception as exc:
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[check] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    print(_table(results), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
