"""``charstream demo --turns 3`` end to end: every stage, real WebRTC, files checked independently. It runs
from a user's folder whose own ``model.py``, ``pipeline.py`` and ``transport/`` raise when imported
(``conftest.user_folder``): no import of the demo's reaches them."""

import json
import re
import subprocess
import sys

import av
import pytest

from charstream.stages.agents.tts import synthesize
from charstream.stages.config import IngestConfig
from charstream.timeline import TRACE_POINTS

SCRIPT = [  # short lines keep the run well under a minute on two cores
    {"user": "Hello there.", "agent": "Hi! Nice to meet you."},
    {"user": "How are you?", "agent": "Very well, thanks."},
    {"user": "Goodbye.", "agent": "Bye for now!"},
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory, user_folder):
    out = tmp_path_factory.mktemp("demo-out")
    script = out.parent / "script.json"
    script.write_text(json.dumps(SCRIPT))
    proc = subprocess.run([sys.executable, "-m", "charstream", "demo", "--turns", "3", "--out", str(out),
                           "--script", str(script)], cwd=user_folder, capture_output=True, text=True, timeout=150)
    return proc, out


def test_demo_exits_0_and_shows_each_turn(demo):
    proc, _ = demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # One progress line per turn with its latencies (turn ids count the user's utterances, as VAD saw them).
    assert len(re.findall(r"^turn \d+: agent \d+ ms · pipeline", proc.stdout.replace("\r", "\n"), re.M)) == 3


def test_trace_holds_three_turns_with_all_seven_stamps_in_order(demo):
    _, out = demo
    lines = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    turns = [line for line in lines if line.get("event") == "turn"]
    ids = [t["turn_id"] for t in turns]
    assert len(ids) == 3 and ids == sorted(set(ids))
    for t in turns:
        stamps = t["stamps"]
        assert set(stamps) == set(TRACE_POINTS), t
        values = [stamps[p] for p in TRACE_POINTS]
        assert values == sorted(values), t
    report = (out / "report.md").read_text()
    assert "| segment | pipeline | 3 |" in report
    assert (out / "waterfall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_playout_json_counts_underruns_by_cause_and_the_summary_prints_them(demo):
    proc, out = demo
    playout = json.loads((out / "playout.json").read_text())
    causes = ("onset", "speech", "listening")
    assert playout["frames_played"] > 0 and playout["rollbacks"] >= 3
    assert sum(playout[f"{c}_underruns"] for c in causes) == playout["underruns"]
    assert sum(playout[f"{c}_underrun_frames"] for c in causes) == playout["underrun_frames"]
    assert re.search(r"^underruns by cause \(frames held\): onset \d+ \(\d+\), speech \d+ \(\d+\), "
                     r"listening \d+ \(\d+\)$", proc.stdout, re.M)


def test_session_mp4_is_24_fps_with_audio_and_covers_the_conversation(demo):
    _, out = demo
    stamps = [json.loads(line)["stamps"] for line in (out / "trace.jsonl").read_text().splitlines()]
    last_reply = synthesize(SCRIPT[-1]["agent"], IngestConfig().agent_voice)
    # From the user's first end of speech to the end of the last reply at playout.
    conversation = stamps[-1]["playout_first_speaking_frame"] - stamps[0]["user_speech_end"] + last_reply.duration
    with av.open(str(out / "session.mp4")) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.average_rate == 24
        assert audio.rate == 48_000
        video_s = float(video.duration * video.time_base)
        audio_s = float(audio.duration * audio.time_base)
        frames = sum(1 for _ in container.decode(video=0))
    assert video_s >= conversation and audio_s >= conversation, (video_s, audio_s, conversation)
    assert frames == pytest.approx(video_s * 24, abs=2)  # every frame there: 24 fps in fact, not just in name


def test_a_session_that_fails_at_start_ends_the_demo_with_its_reason(tmp_path):
    # The scripted agent's recogniser runs on onnxruntime: without it, ingest fails in its setup, before
    # playout exists -- the demo says why and exits 1 (it used to die on the missing playout stats).
    code = ("import runpy, sys; sys.modules['onnxruntime'] = None; "
            f"sys.argv = ['charstream', 'demo', '--turns', '1', '--out', {str(tmp_path)!r}]; "
            "runpy.run_module('charstream', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "charstream demo: the session failed: stage 'ingest' failed: ModuleNotFoundError" in proc.stdout
    assert "KeyError" not in proc.stderr, proc.stderr[-2000:]
