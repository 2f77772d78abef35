"""Bad agent input never ends the session: each case is refused or repaired, logged with the turn id,
and the next good audio still flows. Driven through a PushAdapter (no real-time pacing needed)."""

import anyio
import numpy as np
import pytest
from ingest_support import Recorder

from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import AgentAudioFrame, AgentDisconnected, AgentTurnEnd, AgentTurnStart
from charstream.stages.ingest.push import PushAdapter
from charstream.stages.ingest.stage import IngestStage
from charstream.timeline import CHARACTERS, TIMELINE_RATE, Timeline
from charstream.transport.messages import TurnKind


def _run(events, max_ahead_s: float = 30.0, timeline: Timeline = CHARACTERS):
    """Push ``events`` through an ingest stage; returns (stage, recorder)."""
    config = IngestConfig(max_ahead_s=max_ahead_s)
    adapter = PushAdapter()
    stage = IngestStage(config, adapter, timeline=timeline)
    rec = Recorder()

    async def main():
        ctx = rec.context()
        await stage.setup(ctx)

        async def feed():
            for event in events:
                await adapter.push(event)
            await adapter.end()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed)
                await stage.run(ctx)
        await stage.teardown()

    anyio.run(main)
    return stage, rec


def _tone(rate: int, seconds: float = 0.1, dtype=np.int16) -> np.ndarray:
    x = 0.3 * np.sin(2 * np.pi * 440 * np.arange(int(rate * seconds)) / rate)
    return (x * 32767).astype(np.int16) if dtype == np.int16 else x.astype(dtype)


def _errors(rec, event):
    return [e for e in rec.log_events("error") + rec.log_events("warning") if e["event"] == event]


@pytest.mark.parametrize("frame,problem", [
    (AgentAudioFrame(_tone(16_000), 12_345), "unsupported sample rate 12345 Hz"),
    (AgentAudioFrame(_tone(16_000).astype(np.int32), 16_000), "unsupported sample format 'int32'"),
    (AgentAudioFrame(_tone(16_000), 16_000, channels=6), "unsupported channel count 6"),
    (AgentAudioFrame(_tone(16_000)[:1001], 16_000, channels=2), "not a whole number of 2-channel frames"),
    (AgentAudioFrame(_tone(16_000).reshape(-1, 2), 16_000), "expected a 1-D"),
])
def test_unusable_audio_is_refused_with_a_clear_error_and_streaming_goes_on(frame, problem):
    good = AgentAudioFrame(_tone(24_000), 24_000)
    stage, rec = _run([AgentTurnStart("a"), good, frame, good, AgentTurnEnd("a")])
    [error] = _errors(rec, "agent_audio_rejected")
    assert problem in error["problem"] and error["turn_id"] == 1
    assert stage.stats.frames_rejected == 1
    # both good frames made it, resampled onto the timeline and contiguous
    audio = rec.audio(1)
    assert sum(len(a.samples) for a in audio) == 2 * int(0.1 * TIMELINE_RATE)
    assert [e.kind for e in rec.turn_events()] == [TurnKind.AGENT_TURN_START, TurnKind.AGENT_TURN_END]


def test_nan_and_clipped_samples_are_repaired_and_logged():
    bad = _tone(22_050, dtype=np.float32) * 5.0  # way past full scale
    bad[100:150] = np.nan
    bad[200] = np.inf
    stage, rec = _run([AgentTurnStart(), AgentAudioFrame(bad, 22_050), AgentTurnEnd()])
    audio = np.concatenate([a.samples for a in rec.audio(1)])
    assert len(audio) == int(0.1 * TIMELINE_RATE) and audio.dtype == np.int16
    [first] = _errors(rec, "agent_audio_bad_samples")
    assert first["turn_id"] == 1 and first["non_finite"] == 51 and first["clipped"] > 1_000
    [summary] = _errors(rec, "agent_audio_repaired")
    assert summary["turn_id"] == 1
    # the NaN stretch became silence (±filter ringing), not garbage
    at = int(125 * TIMELINE_RATE / 22_050)
    assert np.abs(audio[at - 20:at + 20].astype(np.int32)).max() < 0.2 * 32767


def test_turn_end_without_a_start_is_logged_and_ignored():
    tone = AgentAudioFrame(_tone(16_000), 16_000)
    stage, rec = _run([AgentTurnStart(), tone, AgentTurnEnd(), AgentTurnEnd("stray"),
                       AgentTurnStart(), tone, AgentTurnEnd()])
    [error] = _errors(rec, "agent_protocol_error")
    assert "turn end without a start" in error["problem"] and error["turn_id"] == 1
    assert error["turn_ref"] == "stray"
    assert len(rec.audio(2)) > 0  # the next turn streams normally
    ends = [e.turn_id for e in rec.turn_events() if e.kind == TurnKind.AGENT_TURN_END]
    assert ends == [1, 2]


def test_audio_without_a_turn_start_opens_a_turn():
    stage, rec = _run([AgentAudioFrame(_tone(16_000), 16_000), AgentTurnEnd()])
    assert [e.kind for e in rec.turn_events()] == [TurnKind.AGENT_TURN_START, TurnKind.AGENT_TURN_END]
    assert _errors(rec, "agent audio without a turn start: turn started")
    assert "agent_first_audio" in rec.audio(1)[0].trace.stamps


def test_agent_disconnecting_mid_turn_ends_the_turn_and_the_session_keeps_going():
    tone = AgentAudioFrame(_tone(16_000), 16_000)
    stage, rec = _run([AgentTurnStart(), tone, AgentDisconnected("socket silent for 1.5 s"),
                       AgentTurnStart(), tone, AgentTurnEnd()])
    [error] = _errors(rec, "agent_protocol_error")
    assert "disconnected mid-turn" in error["problem"] and error["turn_id"] == 1
    kinds = [(e.kind, e.turn_id) for e in rec.turn_events()]
    assert kinds == [(TurnKind.AGENT_TURN_START, 1), (TurnKind.AGENT_TURN_END, 1),
                     (TurnKind.AGENT_TURN_START, 2), (TurnKind.AGENT_TURN_END, 2)]
    assert len(rec.audio(2)) > 0


def test_a_burst_is_paced_to_the_media_clock():
    """A TTS faster than real time: 1 s of audio pushed at once is emitted no more than
    max_ahead_s ahead of the media clock (bounded, like every queue)."""
    frames = [AgentAudioFrame(_tone(24_000, 0.02), 24_000) for _ in range(50)]
    stage, rec = _run([AgentTurnStart(), *frames, AgentTurnEnd()], max_ahead_s=0.2)
    for sent_at, msg in rec.data:
        if hasattr(msg, "start_sample"):
            assert msg.start_sample / TIMELINE_RATE <= sent_at - stage.media_t0 + 0.2 + 0.02
    audio = rec.audio(1)
    assert sum(len(a.samples) for a in audio) == TIMELINE_RATE


def test_a_burst_fills_a_whole_long_chunk_at_once():
    """Where a chunk is longer than max_ahead_s (25 fps, 28 frames: 1.12 s), a faster-than-real-time
    agent's first chunk of audio goes out at once: conditioning builds a chunk only once it is all in."""
    timeline = Timeline(fps=25, frames_per_chunk=28)
    frames = [AgentAudioFrame(_tone(24_000, 0.02), 24_000) for _ in range(100)]  # 2 s pushed at once
    stage, rec = _run([AgentTurnStart(), *frames, AgentTurnEnd()], max_ahead_s=0.2, timeline=timeline)
    first_chunk = [(at, m) for at, m in rec.data if hasattr(m, "start_sample")
                   and m.start_sample - rec.audio(1)[0].start_sample < timeline.samples_per_chunk]
    assert first_chunk[-1][0] - first_chunk[0][0] < 0.2  # not paced over the chunk's 1.12 s
    for sent_at, msg in rec.data:  # and no further ahead than one chunk
        if hasattr(msg, "start_sample"):
            assert msg.start_sample / TIMELINE_RATE <= sent_at - stage.media_t0 + timeline.chunk_seconds + 0.02
