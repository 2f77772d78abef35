"""``charstream quality``: judge a numerics change against rerun variance.

Both sides generate the same N held-out clips (synthesised speech the model never saw), K times
each with different sampler seeds; every run is scored for lip sync. The candidate passes when
the bootstrap 95% CI of the mean per-clip change lies within a margin derived from the rerun
variance (or the fixed +-0.08 of the reference write-up, ``--fixed-margin``). ``--session-minutes``
adds the long-session mode: one session of that length scored in windows, its slope with a CI,
which must imply less change over 10 minutes than the rerun band.

A config (JSON file, or the name of one in ``pipeline/quality/configs``) names the cache mode:
``{"name": ..., "cache": "naive" | "ring", "fp8": bool, "fault": null | "rope_off_by_one" | "scale_x4"}``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from charstream.pipeline.quality.rollout import GateConfig, Rollout, load_config
from charstream.pipeline.quality.stats import FIXED_MARGIN, Comparison, Drift, compare, drift, rerun_sd


def score_matrix(gen: Rollout, clip_seeds: list[int], reruns: int, n_frames: int, progress: str) -> np.ndarray:
    """(clips, reruns) lip-sync confidences; rerun r uses sampler seed r on every clip."""
    from tqdm import tqdm

    scores = np.zeros((len(clip_seeds), reruns))
    with tqdm(total=scores.size, desc=progress, unit="run", mininterval=2.0) as bar:
        for i, clip in enumerate(clip_seeds):
            for r in range(reruns):
                scores[i, r] = gen.score_clip(clip, r, n_frames).confidence
                bar.update(1)
    return scores


def session_drift(gen: Rollout, minutes: float, window_s: float, band: float, seed: int) -> Drift:
    frames, audio = gen.session(seed, minutes)
    times, scores = gen.window_scores(frames, audio, window_s)
    return drift(np.array(times), np.array(scores), band, window_s)


def _plot_comparison(cmp: Comparison, base: np.ndarray, cand: np.ndarray, names: tuple[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(cmp.n_clips)
    for side, s, off in ((names[0], base, -0.12), (names[1], cand, 0.12)):
        a.scatter(np.repeat(x + off, s.shape[1]), s.ravel(), s=12, label=side)
    a.set_xlabel("held-out clip")
    a.set_ylabel("lip-sync confidence")
    a.set_title("every run (reruns = sampler seeds)")
    a.legend()
    b.bar(x, cmp.per_clip_diff, color="tab:gray")
    b.axhspan(cmp.ci_low, cmp.ci_high, color="tab:blue", alpha=0.3, label="95% CI of the mean change")
    for m in (-cmp.margin, cmp.margin):
        b.axhline(m, color="tab:red", ls="--")
    b.axhline(cmp.mean_diff, color="tab:blue")
    b.set_xlabel("held-out clip")
    b.set_ylabel("candidate - baseline")
    b.set_title(f"{'PASS' if cmp.passed else 'FAIL'}: margin +-{cmp.margin:.3f} ({cmp.margin_kind})")
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_drift(d: Drift, path: Path, ylabel: str = "lip-sync confidence") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array(d.times_s) / 60.0
    s = np.array(d.scores)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, s, "o-", ms=3, label=f"{d.window_s:.0f} s windows")
    fit = np.polyfit(t, s, 1)
    ax.plot(t, np.polyval(fit, t), "k--", label=f"slope {d.slope_per_min:+.4f}/min")
    ax.axhspan(s.mean() - d.band, s.mean() + d.band, color="tab:green", alpha=0.15, label="rerun band")
    ax.set_xlabel("session time, minutes")
    ax.set_ylabel(ylabel)
    ax.set_title(f"drift {'PASS' if d.passed else 'FAIL'}: 10-min change CI "
                 f"[{d.change_10min[0]:+.3f}, {d.change_10min[1]:+.3f}] vs band +-{d.band:.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out: Path, base_cfg: GateConfig, cand_cfg: GateConfig, cmp: Comparison | None,
           base: np.ndarray | None, cand: np.ndarray | None, d: Drift | None, clip_seconds: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Quality gate: `{cand_cfg.name}` against `{base_cfg.name}`", ""]
    if cmp is not None:
        _plot_comparison(cmp, base, cand, (base_cfg.name, cand_cfg.name), out / "gate.png")
        lines += [
            f"**{'PASS' if cmp.passed else 'FAIL'}** — {cmp.n_clips} held-out clips of {clip_seconds:.0f} s, "
            f"{cmp.k_reruns} reruns per side (sampler seeds 0..{cmp.k_reruns - 1}).", "",
            "| | value |", "|---|---|",
            f"| baseline mean confidence | {cmp.baseline_mean:.4f} |",
            f"| candidate mean confidence | {cmp.candidate_mean:.4f} |",
            f"| rerun sd of one run, baseline (sets the margin) | {cmp.rerun_sd:.4f} |",
            f"| rerun sd of one run, candidate | {cmp.candidate_rerun_sd:.4f} |",
            f"| mean change (candidate - baseline) | {cmp.mean_diff:+.4f} |",
            f"| bootstrap 95% CI | [{cmp.ci_low:+.4f}, {cmp.ci_high:+.4f}] |",
            f"| margin ({cmp.margin_kind}) | +-{cmp.margin:.4f} |", "",
            "Per clip (mean over reruns):", "",
            "| clip | baseline | candidate | change |", "|---|---|---|---|",
        ]
        lines += [f"| {i} | {base[i].mean():.4f} | {cand[i].mean():.4f} | {cmp.per_clip_diff[i]:+.4f} |"
                  for i in range(cmp.n_clips)]
        lines += ["", "![gate](gate.png)", ""]
    if d is not None:
        _plot_drift(d, out / "drift.png")
        lines += [
            f"## Long session: {d.times_s[-1] / 60 + d.window_s / 120:.1f} minutes of `{cand_cfg.name}`", "",
            f"**{'PASS' if d.passed else 'FAIL'}** — slope {d.slope_per_min:+.5f} per minute "
            f"(95% CI [{d.ci_low:+.5f}, {d.ci_high:+.5f}]); change over 10 minutes "
            f"[{d.change_10min[0]:+.4f}, {d.change_10min[1]:+.4f}] against the rerun band +-{d.band:.4f}; "
            f"window mean {np.mean(d.scores):.4f}.", "", "![drift](drift.png)", "",
        ]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    (out / "result.json").write_text(json.dumps({
        "baseline": asdict(base_cfg), "candidate": asdict(cand_cfg),
        "comparison": asdict(cmp) if cmp else None, "drift": asdict(d) if d else None,
        "baseline_scores": base.tolist() if base is not None else None,
        "candidate_scores": cand.tolist() if cand is not None else None,
    }, indent=1))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, help="config JSON path or built-in name (naive-bf16, ...)")
    parser.add_argument("--candidate", required=True, help="config JSON path or built-in name (fp8-ring, ...)")
    parser.add_argument("--clips", type=int, default=8, help="N held-out clips")
    parser.add_argument("--reruns", type=int, default=3, help="K sampler seeds per clip and side")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each held-out clip")
    parser.add_argument("--fixed-margin", type=float, nargs="?", const=FIXED_MARGIN, default=None,
                        help=f"judge against a fixed margin (default {FIXED_MARGIN}) instead of rerun variance")
    parser.add_argument("--session-minutes", type=float, default=0.0, help="long-session drift mode (0: off)")
    parser.add_argument("--window-s", type=float, default=30.0, help="drift window length")
    parser.add_argument("--device", default=None, help="override the configs' device")
    parser.add_argument("--out", type=Path, default=Path("quality-out"))
    parser.add_argument("--from-result", type=Path, default=None,
                        help="judge the scores saved in a result.json again (no generation; e.g. another margin)")


def run(args: argparse.Namespace) -> int:
    try:
        base_cfg, cand_cfg = load_config(args.baseline), load_config(args.candidate)
    except (OSError, ValueError) as e:  # no such config, or one that does not validate
        raise SystemExit(f"charstream quality: {e}") from None
    if args.from_result is not None:
        saved = json.loads(args.from_result.read_text())
        base, cand = np.array(saved["baseline_scores"]), np.array(saved["candidate_scores"])
        cmp = compare(base, cand, args.fixed_margin)
        path = report(args.out, base_cfg, cand_cfg, cmp, base, cand, None, args.seconds)
        print(path.read_text())
        return 0 if cmp.passed else 1
    if args.device:
        base_cfg.device = cand_cfg.device = args.device
    n_frames = int(round(args.seconds * 24 / 4)) * 4
    clip_seeds = list(range(args.clips))
    base_gen, cand_gen = Rollout(base_cfg), Rollout(cand_cfg)
    base = score_matrix(base_gen, clip_seeds, args.reruns, n_frames, base_cfg.name)
    cand = score_matrix(cand_gen, clip_seeds, args.reruns, n_frames, cand_cfg.name)
    cmp = compare(base, cand, args.fixed_margin)
    d = None
    if args.session_minutes > 0:
        band = 2.0 * rerun_sd(cand)  # ~95% of one run's rerun spread
        d = session_drift(cand_gen, args.session_minutes, args.window_s, band, seed=1000)
    path = report(args.out, base_cfg, cand_cfg, cmp, base, cand, d, n_frames / 24)
    print(path.read_text())
    return 0 if cmp.passed and (d is None or d.passed) else 1
