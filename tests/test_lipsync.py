import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from charstream.pipeline.quality.lipsync import mouth_openness, score_av, speech_envelope, sync_score
from charstream.pipeline.training.data import make_clip


@pytest.fixture(scope="module")
def clips():
    return [make_clip(seed, 144, "heldout") for seed in range(4)]  # 6 s each


def test_ground_truth_renders_score_high_at_zero_offset(clips):
    for clip in clips:
        score = score_av(clip.frames.numpy(), clip.audio)
        assert score.confidence > 0.9 and score.offset_frames == 0, score


def test_shuffled_audio_scores_near_zero(clips):
    shuffled = [score_av(c.frames.numpy(), clips[(i + 1) % len(clips)].audio).confidence for i, c in enumerate(clips)]
    assert np.mean(shuffled) < 0.3, shuffled


def test_offset_is_found_with_its_sign(clips):
    clip = clips[0]
    openness, env = mouth_openness(clip.frames.numpy()), speech_envelope(clip.audio)
    lag = 3  # the mouth moves 3 frames after the sound
    late = np.concatenate([np.full(lag, openness[0]), openness[:-lag]])
    score = sync_score(late, env)
    assert score.offset_frames == lag and score.confidence > 0.9
    assert score.correlations[score.offset_frames + 6] == max(score.correlations)


def test_too_short_or_malformed_input_is_a_clear_error():
    with pytest.raises(ValueError, match="at least"):
        sync_score(np.zeros(10), np.zeros(10))
    with pytest.raises(ValueError, match="4-D"):
        mouth_openness(np.zeros((3, 128, 128), np.uint8))


def _write_mp4(path, frames: np.ndarray, audio: np.ndarray, pts: list[int] | None = None) -> None:
    import av

    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 128, 128, "yuv420p"
        sound = out.add_stream("aac", rate=48_000, layout="mono")
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f.transpose(1, 2, 0)), format="rgb24")
            vf.pts, vf.time_base = (i if pts is None else pts[i]), Fraction(1, 24)
            out.mux(video.encode(vf))
        out.mux(video.encode())
        for start in range(0, len(audio), 1024):
            af = av.AudioFrame.from_ndarray(audio[None, start:start + 1024], format="s16", layout="mono")
            af.sample_rate, af.pts = 48_000, start
            out.mux(sound.encode(af))
        out.mux(sound.encode())


def test_cli_scores_an_mp4_and_a_session_dir(clips, tmp_path, capsys):
    from charstream.pipeline.cli import main

    clip = clips[1]
    _write_mp4(tmp_path / "session.mp4", clip.frames.numpy(), clip.audio)
    out = subprocess.run([sys.executable, "-m", "charstream", "lipsync", str(tmp_path / "session.mp4"), "--json"],
                         capture_output=True, text=True, check=True)
    capsys.readouterr()
    assert main(["lipsync", str(tmp_path), "--json"]) == 0  # the session directory holding it, in process
    for score in (json.loads(out.stdout), json.loads(capsys.readouterr().out)):
        # AAC's encoder delay may shift the audio by under a frame; H.264 blurs the mouth slightly
        assert score["confidence"] > 0.8 and abs(score["offset_frames"]) <= 1, score


def test_cli_says_why_it_cannot_score_without_a_traceback(tmp_path):
    from charstream.pipeline.cli import main

    (tmp_path / "garbage.mp4").write_bytes(b"\x00not an mp4" * 100)
    (tmp_path / "empty").mkdir()
    for target, why in ((tmp_path / "nope.mp4", "no such file"), (tmp_path / "empty", "no .mp4 in this session"),
                        (tmp_path / "garbage.mp4", "Invalid data")):
        with pytest.raises(SystemExit, match=f"charstream lipsync: .*{why}"):
            main(["lipsync", str(target)])


def test_a_stall_in_the_recording_is_held_on_the_frame_grid(clips, tmp_path):
    from charstream.pipeline.quality.lipsync import read_mp4

    frames = clips[2].frames.numpy()[:48]
    pts = list(range(20)) + [p + 10 for p in range(20, 48)]  # a 10-frame stall after frame 19
    _write_mp4(tmp_path / "stall.mp4", frames, clips[2].audio[: 58 * 2000], pts)
    video, audio = read_mp4(tmp_path / "stall.mp4")
    assert len(video) == 58 and len(audio) >= 57 * 2000
    assert np.array_equal(video[19], video[29]) and not np.array_equal(video[29], video[30])
