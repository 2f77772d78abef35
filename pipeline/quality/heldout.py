"""Held-out lip-sync evaluation of the trained character, and the 10-minute drift session.

    python -m charstream.pipeline.quality.heldout --config fp8-ring --clips 16 --reruns 2 --out eval/

For each held-out clip (speech the model never saw, the demo's character): the lip-sync
confidence and offset of the generated video, the same for the ground-truth render (the
scorer's ceiling), and a shuffled-audio control (the generated video against another clip's
speech). With ``--session-minutes``, one long session scored in windows: the slope (with a bootstrap
CI) of the generated window score minus the ground-truth render's, against the rerun band (the
gate's margin: 3 x the clips' rerun standard deviation, at least 0.005).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from charstream.model.character import make_identity, render
from charstream.pipeline.quality.gate import _plot_drift
from charstream.pipeline.quality.lipsync import mouth_openness, speech_envelope, sync_score
from charstream.pipeline.quality.rollout import Rollout, load_config
from charstream.pipeline.quality.stats import MIN_MARGIN, drift, rerun_sd
from charstream.pipeline.training.data import make_script


def evaluate(rollout: Rollout, clips: int, reruns: int, seconds: float) -> dict:
    n_frames = int(round(seconds * 6)) * 4
    scripts = [make_script(i, n_frames, "heldout") for i in range(clips)]
    envs = [speech_envelope(s.audio) for s in scripts]
    rows = []
    for i, script in enumerate(scripts):
        runs = [rollout.openness(script.audio, seed=r) for r in range(reruns)]
        gen = [sync_score(o, envs[i]) for o in runs]
        shuffled = sync_score(runs[0], envs[(i + 1) % clips])
        truth = render(make_identity(rollout.config.identity), script.motion)
        gt = sync_score(mouth_openness(truth.numpy()), envs[i])
        rows.append({"clip": i, "voice": script.voice, "confidence": [g.confidence for g in gen],
                     "offset": [g.offset_frames for g in gen], "shuffled": shuffled.confidence,
                     "ground_truth": gt.confidence, "ground_truth_offset": gt.offset_frames})
    conf = np.array([r["confidence"] for r in rows])
    offs = np.array([r["offset"] for r in rows])
    return {
        "clips": clips, "reruns": reruns, "seconds": n_frames / 24, "config": asdict(rollout.config),
        "mean_confidence": float(conf.mean()), "min_clip_confidence": float(conf.mean(axis=1).min()),
        "share_offset_within_1": float((np.abs(offs) <= 1).mean()),
        "median_offset": float(np.median(offs)),
        "mean_shuffled": float(np.mean([r["shuffled"] for r in rows])),
        "mean_ground_truth": float(np.mean([r["ground_truth"] for r in rows])),
        "rerun_sd": rerun_sd(conf) if reruns >= 2 else None,
        "rows": rows,
    }


def frames_figure(rollout: Rollout, path: Path, clip: int = 0, frames: int = 8, seconds: float = 4.0) -> None:
    """A strip of ``frames`` generated frames of held-out clip ``clip`` (top) over the ground-truth
    render of the same speech (bottom), evenly spaced over its first ``seconds``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    script = make_script(clip, int(round(seconds * 6)) * 4, "heldout")
    generated = rollout.video(script.audio, seed=0).cpu().numpy()  # (frames, H, W, 3) uint8
    truth = render(make_identity(rollout.config.identity), script.motion).permute(0, 2, 3, 1).numpy()
    picks = np.linspace(0, len(generated) - 1, frames).round().astype(int)
    fig, axes = plt.subplots(2, frames, figsize=(1.6 * frames, 3.6))
    for col, i in enumerate(picks):
        for row, (name, video) in enumerate((("generated", generated), ("ground truth", truth))):
            ax = axes[row, col]
            ax.imshow(video[i])
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(name)
        axes[0, col].set_title(f"{i / 24:.2f} s", fontsize=8)
    fig.suptitle(f"held-out clip {clip}, config `{rollout.config.name}`", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(result: dict) -> str:
    lines = [
        f"Held-out lip sync: {result['clips']} clips x {result['reruns']} reruns of {result['seconds']:.0f} s, "
        f"config `{result['config']['name']}`", "",
        "| | value |", "|---|---|",
        f"| mean confidence (generated) | {result['mean_confidence']:.3f} |",
        f"| lowest clip mean | {result['min_clip_confidence']:.3f} |",
        f"| runs with best offset within +-1 frame | {100 * result['share_offset_within_1']:.0f}% |",
        f"| median offset, frames | {result['median_offset']:+.0f} |",
        f"| shuffled-audio control | {result['mean_shuffled']:.3f} |",
        f"| ground-truth render (scorer ceiling) | {result['mean_ground_truth']:.3f} |",
    ]
    if result["rerun_sd"] is not None:
        lines.append(f"| rerun sd of one clip's score | {result['rerun_sd']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="fp8-ring")
    p.add_argument("--weights", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clips", type=int, default=16, help="0: session only (then give --band)")
    p.add_argument("--reruns", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--session-minutes", type=float, default=0.0)
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--band", type=float, default=None,
                   help="drift band (default: the gate's rerun margin from the clips' rerun sd)")
    p.add_argument("--out", type=Path, default=Path("heldout-out"))
    p.add_argument("--figure", action="store_true", help="also write generated_vs_truth.png (held-out clip 0)")
    args = p.parse_args(argv)
    config = load_config(args.config)
    config.device = args.device
    if args.weights:
        config.weights = args.weights
    rollout = Rollout(config)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": asdict(config)}
    text = ""
    if args.clips > 0:
        result = evaluate(rollout, args.clips, args.reruns, args.seconds)
        text = markdown(result)
        (args.out / "heldout.json").write_text(json.dumps(result, indent=1))  # kept if the session is cut short
        print(text, flush=True)
    if args.session_minutes > 0:
        openness, truth, audio = rollout.session(0, args.session_minutes)
        times, scores = rollout.window_scores(openness, audio, args.window_s)
        _, truth_scores = rollout.window_scores(truth, audio, args.window_s)
        band = args.band if args.band is not None else max(3.0 * result["rerun_sd"], MIN_MARGIN)
        # The criterion: the generated score relative to the ground-truth render of the same speech,
        # so what each window says (its content) cancels and only the model's drift remains.
        rel = np.array(scores) - np.array(truth_scores)
        d = drift(np.array(times), rel, band, args.window_s)
        raw = drift(np.array(times), np.array(scores), band, args.window_s)
        result["drift"] = asdict(d)
        result["drift_raw"] = asdict(raw)
        result["session_truth_scores"] = truth_scores
        _plot_drift(d, args.out / "drift.png", "generated - ground-truth confidence")
        text += (f"\nDrift over a {args.session_minutes:g}-minute session ({args.window_s:g} s windows), generated "
                 f"minus ground-truth window score: **{'PASS' if d.passed else 'FAIL'}**, slope "
                 f"{d.slope_per_min:+.5f}/min, 10-minute change CI [{d.change_10min[0]:+.4f}, "
                 f"{d.change_10min[1]:+.4f}] vs band +-{band:.4f}. Raw window scores: mean {np.mean(scores):.3f}, "
                 f"min {np.min(scores):.3f}, slope {raw.slope_per_min:+.5f}/min (10-minute CI "
                 f"[{raw.change_10min[0]:+.4f}, {raw.change_10min[1]:+.4f}]).\n")
        print(text, flush=True)
    (args.out / "heldout.json").write_text(json.dumps(result, indent=1))
    (args.out / "heldout.md").write_text(text)
    if args.figure:
        frames_figure(rollout, args.out / "generated_vs_truth.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
