"""Lip-sync score: mouth openness read from frames against the speech envelope.

The character's layout is known (``model.character``): the mouth interior is the only
near-black region inside ``MOUTH_BOX``. Openness per frame is the soft fraction of dark pixels
there; the speech envelope per frame is the level (dBFS, clipped to a 35 dB range) of the
frame's 2,000 timeline samples. Like SyncNet, we report the best offset within a search window
and the confidence there, here the Pearson correlation of the two signals at that offset.

``charstream lipsync`` scores an mp4 (video + audio, read with PyAV) or a demo session dir
(an mp4 inside it).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from charstream.model.character import MOUTH_BOX
from charstream.timeline import CHARACTERS, TIMELINE_RATE

ENVELOPE_FLOOR_DB = -50.0  # silence and breath: mouth closed
ENVELOPE_RANGE_DB = 35.0  # from closed to fully open
DARK_LUMA = 0.25  # mouth interior is below, lips and skin above
MAX_OFFSET_FRAMES = 6  # search window: +-250 ms
MIN_FRAMES = 24  # below one second a correlation says little


@dataclass
class SyncScore:
    confidence: float  # Pearson correlation at the best offset
    offset_frames: int  # > 0: the mouth lags the audio by this many frames
    frames: int
    correlations: list[float]  # at offsets -MAX_OFFSET..+MAX_OFFSET


def speech_envelope(samples: np.ndarray, samples_per_frame: int = CHARACTERS.samples_per_frame) -> np.ndarray:
    """Per-frame level in [0, 1]: dBFS of each frame's samples mapped from the floor over the range."""
    x = np.asarray(samples, np.float64)
    if x.dtype.kind == "i" or np.abs(x).max(initial=0) > 1.5:
        x = x / 32768.0
    n = len(x) // samples_per_frame
    rms = np.sqrt(np.mean(x[: n * samples_per_frame].reshape(n, samples_per_frame) ** 2, axis=1) + 1e-12)
    db = 20.0 * np.log10(rms + 1e-6)
    return np.clip((db - ENVELOPE_FLOOR_DB) / ENVELOPE_RANGE_DB, 0.0, 1.0)


def mouth_openness(frames: np.ndarray) -> np.ndarray:
    """Soft fraction of dark pixels in the mouth box, per frame; frames uint8 (T, 3, H, W) or (T, H, W, 3)."""
    f = np.asarray(frames)
    if f.ndim != 4:
        raise ValueError(f"frames must be 4-D (T, 3, H, W) or (T, H, W, 3), got shape {f.shape}")
    if f.shape[1] != 3:
        f = f.transpose(0, 3, 1, 2)
    y0, y1, x0, x1 = MOUTH_BOX
    return box_openness(f[:, :, y0:y1, x0:x1])


def box_openness(box_u8: np.ndarray) -> np.ndarray:
    """Openness of mouth-box crops, uint8 (T, 3, h, w): the soft share of near-black pixels."""
    box = np.asarray(box_u8).astype(np.float32) / 255.0
    luma = 0.299 * box[:, 0] + 0.587 * box[:, 1] + 0.114 * box[:, 2]
    dark = 1.0 / (1.0 + np.exp((luma - DARK_LUMA) / 0.04))
    return dark.mean(axis=(1, 2))


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a = a - a.mean()
    b = b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 1e-12 else 0.0


def sync_score(openness: np.ndarray, envelope: np.ndarray, max_offset: int = MAX_OFFSET_FRAMES) -> SyncScore:
    """Best-offset correlation of openness[t] with envelope[t - offset] over |offset| <= max_offset."""
    n = min(len(openness), len(envelope))
    if n < MIN_FRAMES + 2 * max_offset:
        raise ValueError(f"need at least {MIN_FRAMES + 2 * max_offset} frames to score lip sync, got {n}")
    o, e = np.asarray(openness[:n], np.float64), np.asarray(envelope[:n], np.float64)
    corrs = []
    for off in range(-max_offset, max_offset + 1):
        # the same number of frames at every offset, so the correlations compare fairly
        corrs.append(_pearson(o[max_offset + off: n - max_offset + off], e[max_offset: n - max_offset]))
    best = int(np.argmax(corrs))
    return SyncScore(float(corrs[best]), best - max_offset, n, [round(c, 4) for c in corrs])


def score_av(frames: np.ndarray, samples: np.ndarray, max_offset: int = MAX_OFFSET_FRAMES) -> SyncScore:
    """Score frames (24 fps) against their 48 kHz timeline audio."""
    return sync_score(mouth_openness(frames), speech_envelope(samples), max_offset)


def read_mp4(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Frames uint8 (T, H, W, 3) on the 24 fps grid and mono audio resampled to the 48 kHz timeline (int16)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video or not container.streams.audio:
            raise ValueError(f"{path}: need one video and one audio stream to score lip sync")
        # Place each frame on the 24 fps grid by its timestamp, holding it until the next one:
        # a recording timed by RTP timestamps shows a stall as one long frame, as the viewer saw it.
        frames: list[np.ndarray] = []
        for f in container.decode(video=0):
            slot = round((f.time or 0.0) * CHARACTERS.fps)
            while frames and len(frames) < slot:
                frames.append(frames[-1])
            if len(frames) <= slot or not frames:
                frames.append(f.to_ndarray(format="rgb24"))
        if not frames:
            raise ValueError(f"{path}: the video stream holds no frames")
    resampler = av.AudioResampler(format="s16", layout="mono", rate=TIMELINE_RATE)
    chunks = []
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    return np.stack(frames), audio


def find_video(path: Path) -> Path:
    if path.is_dir():
        videos = sorted(path.glob("*.mp4"))
        if not videos:
            raise FileNotFoundError(f"{path}: no .mp4 in this session directory")
        return videos[0]
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="an mp4 with audio, or a demo session directory holding one")
    parser.add_argument("--max-offset", type=int, default=MAX_OFFSET_FRAMES, help="search window, frames")
    parser.add_argument("--shuffled", action="store_true",
                        help="control: score against the audio reversed in time (no sync possible)")
    parser.add_argument("--json", action="store_true", help="print the score as JSON")


def run(args: argparse.Namespace) -> int:
    import av

    try:
        video = find_video(args.path)
        frames, audio = read_mp4(video)
    except (OSError, ValueError, av.FFmpegError) as e:  # a missing, unreadable or unscorable file: say which
        raise SystemExit(f"charstream lipsync: {e}") from None
    if args.shuffled:
        audio = audio[::-1].copy()
    score = score_av(frames, audio, args.max_offset)
    if args.json:
        print(json.dumps(asdict(score)))
    else:
        print(f"{video}: confidence {score.confidence:.3f} at offset {score.offset_frames:+d} frames "
              f"({score.frames} frames)")
    return 0
