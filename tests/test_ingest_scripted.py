"""The scripted agent through the ingest stage, in real time: real espeak voices, real silero-vad.

One conversation of two lines, the second barging in on the first reply, covers: end of speech
detected (not assumed) and back-dated, the think delay, the reply streamed at real-time pace on the
48 kHz timeline, and barge-in stopping the character within one chunk.
"""

import anyio
import numpy as np
import pytest
from ingest_support import Recorder

from charstream.stages.agents.scripted import ScriptedAgent, ScriptLine
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import create_adapter
from charstream.stages.ingest.stage import IngestStage
from charstream.timeline import CHARACTERS, TIMELINE_RATE
from charstream.transport.messages import ControlKind, TurnKind

THINK_S = 0.25
SCRIPT = [
    ScriptLine("What is the weather like today?",
               "It is sunny and warm today, with a light breeze from the west all afternoon and evening."),
    ScriptLine("Wait, what about tomorrow?", "Tomorrow brings rain.", barge_in_after_s=1.0),
]


@pytest.fixture(scope="module")
def conversation():
    config = IngestConfig(think_delay_s=THINK_S, lead_in_s=0.3)
    agent = ScriptedAgent(config, script=SCRIPT)
    stage = IngestStage(config, agent)
    return stage, agent, _run(stage, 30)


def _run(stage: IngestStage, timeout_s: float) -> Recorder:
    """What ``stage`` emits from setup to the end of its script (a hang guard: ``timeout_s``)."""
    rec = Recorder()

    async def main():
        ctx = rec.context()
        await stage.setup(ctx)
        with anyio.fail_after(timeout_s):
            await stage.run(ctx)
        await stage.teardown()

    anyio.run(main)
    return rec


def _truth(agent, what, line):
    return [t for w, i, t in agent.truth if w == what and i == line][0]


def test_registry_builds_the_scripted_agent_and_the_built_in_one_by_default():
    from charstream.stages.agents.listening import ListeningAgent

    assert isinstance(create_adapter(IngestConfig(adapter="scripted")), ScriptedAgent)
    assert isinstance(create_adapter(IngestConfig()), ListeningAgent)
    with pytest.raises(ValueError, match="unknown ingest adapter"):
        create_adapter(IngestConfig(adapter="carrier-pigeon"))


def test_turns_are_detected_and_answered_in_order(conversation):
    stage, agent, rec = conversation
    kinds = [(e.kind, e.turn_id) for e in rec.turn_events()]
    assert kinds == [
        (TurnKind.USER_SPEECH_START, 1), (TurnKind.USER_SPEECH_END, 1), (TurnKind.AGENT_TURN_START, 1),
        (TurnKind.INTERRUPT, 1), (TurnKind.USER_SPEECH_START, 2), (TurnKind.AGENT_TURN_END, 1),
        (TurnKind.USER_SPEECH_END, 2), (TurnKind.AGENT_TURN_START, 2), (TurnKind.AGENT_TURN_END, 2),
    ], kinds
    assert stage.stats.turns == 2 and stage.stats.protocol_errors == 0


def test_trace_stamps_come_from_the_vad_and_the_first_audio(conversation):
    stage, agent, rec = conversation
    for turn_id, line in ((1, 0), (2, 1)):
        audio = rec.audio(turn_id)
        stamps = audio[0].trace.stamps
        assert all(a.trace.stamps == stamps for a in audio)
        # user_speech_end: silero's back-dated end, within 100 ms of the synthesised speech's end
        assert abs(stamps["user_speech_end"] - _truth(agent, "user_speech_end", line)) <= 0.100
        # the agent thought for THINK_S after the VAD *detected* the end (silence window later)
        detected = [d for kind, at, d in stage.stats.vad_events
                    if kind == "user_speech_end" and at == stamps["user_speech_end"]][0]
        assert stamps["agent_first_audio"] - detected >= THINK_S - 0.025  # detected_at: within a 20 ms mic frame
        assert stamps["agent_first_audio"] - detected < THINK_S + 1.0  # generous: CI machines are busy
        end_event = [e for e in rec.turn_events() if e.kind == TurnKind.USER_SPEECH_END and e.turn_id == turn_id][0]
        assert end_event.at == stamps["user_speech_end"]


def test_reply_streams_on_the_timeline_at_real_time_pace(conversation):
    stage, agent, rec = conversation
    audio = rec.audio(2)
    assert all(a.sample_rate == TIMELINE_RATE and a.samples.dtype == np.int16 for a in audio)
    for a, b in zip(audio, audio[1:], strict=False):
        assert b.start_sample == a.start_sample + len(a.samples)  # contiguous
    reply = agent._lines[1].agent
    total = sum(len(a.samples) for a in audio)
    assert abs(total - reply.duration * TIMELINE_RATE) <= 1
    # real-time pace (not a burst): emitted over the reply's duration, never ahead of the media clock
    ids = {id(a) for a in audio}
    sent_at = [t for t, m in rec.data if id(m) in ids]
    assert reply.duration - 0.1 <= sent_at[-1] - sent_at[0] <= reply.duration + 1.0
    for t, a in zip(sent_at, audio, strict=True):
        assert a.start_sample / TIMELINE_RATE <= (t - stage.media_t0) + 0.05


def test_barge_in_stops_the_character_within_one_chunk(conversation):
    stage, agent, rec = conversation
    assert stage.stats.interrupts == 1
    [(_, control)] = rec.controls
    assert control.kind == ControlKind.INTERRUPT and control.trace.turn_id == 1
    start = [e for e in rec.turn_events() if e.kind == TurnKind.USER_SPEECH_START and e.turn_id == 2][0]
    detected = [d for kind, at, d in stage.stats.vad_events if kind == "user_speech_start" and at == start.at][0]
    detected_sample = (detected - stage.media_t0) * TIMELINE_RATE
    # the user really started speaking over the reply, and the VAD heard it promptly
    assert abs(start.at - _truth(agent, "user_speech_start", 1)) <= 0.15
    interrupted = rec.audio(1)
    speech_end = interrupted[-1].start_sample + len(interrupted[-1].samples)
    assert interrupted[0].start_sample < detected_sample  # the character was speaking
    assert speech_end - detected_sample <= CHARACTERS.samples_per_chunk  # ... and stopped within one chunk
    # downstream drops from a chunk boundary no later than one chunk after the interrupt
    assert 0 <= control.chunk * CHARACTERS.samples_per_chunk - control.payload.at_sample < CHARACTERS.samples_per_chunk
    # the adapter was told, and its reply was cut short
    assert 0 in agent._interrupted
    reply = agent._lines[0].agent
    assert sum(len(a.samples) for a in interrupted) < 0.8 * reply.duration * TIMELINE_RATE


def test_the_scripted_users_speech_goes_through_the_recogniser(conversation):
    """Each answer says what the recogniser really heard of the user's line (not the script's text)."""
    stage, agent, rec = conversation
    texts = [e for e in rec.log_events("info") if e["event"] == "agent_turn_text"]
    assert [e["answer"] for e in texts] == [line.agent for line in SCRIPT]
    assert "weather" in texts[0]["heard"].lower()  # recognised, as the recogniser hears espeak's voice
    assert all(isinstance(e["heard"], str) for e in texts)


def test_synthesized_pace_pushes_the_reply_ahead_as_far_as_ingest_takes_it():
    """``agent_pace = "synthesized"``: as a TTS service pushes audio, the reply's first max_ahead_s
    arrive at once, then it stays that far ahead of the media clock -- the same audio, contiguous."""
    config = IngestConfig(think_delay_s=0.1, lead_in_s=0.2, agent_pace="synthesized")
    agent = ScriptedAgent(config, script=[ScriptLine("Hello there.", "Hi! Nice to meet you.")])
    stage = IngestStage(config, agent)
    rec = _run(stage, 20)
    [turn_id] = {a.trace.turn_id for a in rec.audio()}
    audio = rec.audio(turn_id)
    ids = {id(a) for a in audio}
    sent_at = [t for t, m in rec.data if id(m) in ids]
    for a, b in zip(audio, audio[1:], strict=False):
        assert b.start_sample == a.start_sample + len(a.samples)  # contiguous
    reply = agent._lines[0].agent
    assert abs(sum(len(a.samples) for a in audio) - reply.duration * TIMELINE_RATE) <= 1
    # The first chunk and its look-ahead (9,920 samples) come with the first frame, not 207 ms later.
    assert len(audio[0].samples) >= CHARACTERS.samples_per_chunk + 1920
    # Each frame starts at most max_ahead_s ahead of the media clock (ingest's bound), most of them about that far.
    ahead = [a.start_sample / TIMELINE_RATE - (t - stage.media_t0) for t, a in zip(sent_at, audio, strict=True)]
    assert max(ahead) <= config.max_ahead_s + 0.01 and np.median(ahead) >= config.max_ahead_s - 0.08, ahead
    with pytest.raises(ValueError, match="agent_pace"):
        ScriptedAgent(IngestConfig(agent_pace="fast"))


def test_synthesized_pace_fills_a_whole_chunk_where_chunks_are_longer():
    """Where a chunk is longer than max_ahead_s (25 fps, 28 frames: 1.12 s), ingest's horizon is a chunk, and
    the scripted agent it builds pushes that far: the first speaking chunk's audio all comes at once, so
    conditioning can build it without waiting for the clock."""
    from charstream.timeline import Timeline

    timeline = Timeline(fps=25, frames_per_chunk=28)
    config = IngestConfig(adapter="scripted", think_delay_s=0.1, lead_in_s=0.2, agent_pace="synthesized",
                          scripted_recognizer=False, script=[{"user": "Hello there.",
                                                              "agent": "Hi! Nice to meet you, it is a lovely day."}])
    stage = IngestStage(config, timeline=timeline)
    rec = _run(stage, 20)
    [turn_id] = {a.trace.turn_id for a in rec.audio()}
    audio = rec.audio(turn_id)
    ids = {id(a) for a in audio}
    sent_at = [t for t, m in rec.data if id(m) in ids]
    first = audio[0].start_sample
    within = sum(len(a.samples) for t, a in zip(sent_at, audio, strict=True) if t - sent_at[0] <= 0.05)
    assert within >= timeline.samples_per_chunk - 1920, (within, first)  # a chunk at once, bar the last frame
    ahead = [a.start_sample / TIMELINE_RATE - (t - stage.media_t0) for t, a in zip(sent_at, audio, strict=True)]
    assert max(ahead) <= timeline.chunk_seconds + 0.01, ahead  # and no further


def test_synthesized_pace_the_user_waits_until_the_reply_is_said():
    """However far ahead the reply's audio is pushed, the simulated user starts the next line only
    ``turn_gap_s`` after the reply, said at its own pace, ends: no line without ``barge_in_after_s`` talks
    over the character (with a chunk-long horizon the push ends 1.12 s before the speech does)."""
    from charstream.timeline import Timeline

    timeline = Timeline(fps=25, frames_per_chunk=28)
    config = IngestConfig(adapter="scripted", think_delay_s=0.1, lead_in_s=0.2,
                          agent_pace="synthesized", scripted_recognizer=False,
                          script=[{"user": "Hello there.", "agent": "Hi! Nice to meet you, it is a lovely day."},
                                  {"user": "It is.", "agent": "Yes."}])
    stage = IngestStage(config, timeline=timeline)
    _run(stage, 30)
    agent = stage.adapter
    said_by = _truth(agent, "agent_turn_start", 0) + agent._lines[0].agent.duration
    assert stage.stats.interrupts == 0
    assert _truth(agent, "user_speech_start", 1) >= said_by + config.turn_gap_s - 0.03


@pytest.mark.parametrize("pace", ["realtime", "synthesized"])
def test_a_late_tick_sends_what_came_due_and_the_reply_never_runs_ahead_of_its_clock(monkeypatch, pace):
    """The agent's clock stalls 200 ms in the middle of a reply (a busy machine): the next tick sends the
    audio that came due meanwhile, the ticks that catch up after it send nothing, and at no time has more
    of the reply gone than its clock allows (one tick ahead; ``max_ahead_s`` when synthesized)."""
    from charstream.stages.agents import scripted
    from charstream.stages.ingest.adapters import AgentAudioFrame, AgentTurnStart
    from charstream.transport.messages import TurnEvent

    config = IngestConfig(think_delay_s=0.1, lead_in_s=0.0, agent_pace=pace, scripted_recognizer=False)
    agent = ScriptedAgent(config, script=[ScriptLine("Hello there.", "Hi! Nice to meet you.")])
    anyio.run(agent.start)
    clock = [1000.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(scripted.time, "time", lambda: clock[0])
    monkeypatch.setattr(scripted.anyio, "sleep", sleep)

    async def main():
        sent, started, stalled = [], None, None
        async for event in agent.events():
            if any(what == "user_speech_end" for what, *_ in agent.truth) and agent._user_end is None:
                await agent.notify(TurnEvent("s", 0, TurnKind.USER_SPEECH_END, 0, clock[0]))
            if isinstance(event, AgentTurnStart):
                started = clock[0]
            elif isinstance(event, AgentAudioFrame) and event.turn_ref is not None:
                sent.append((clock[0], len(event.samples)))
                if stalled is None and clock[0] - started >= 0.5:
                    clock[0] += 0.2  # the next tick runs 200 ms late; ten more are due at once
                    stalled = len(sent)
        return sent, started, stalled

    sent, started, stalled = anyio.run(main)
    rate = agent._lines[0].agent.sample_rate
    lead = scripted.TICK_S if pace == "realtime" else config.max_ahead_s
    total = 0
    for at, n in sent:
        total += n
        assert total <= round(rate * (at - started + lead)) + 1, (at - started, total / rate)
    assert total == len(agent._lines[0].agent.samples)
    assert sent[stalled][1] >= rate * 0.2  # the late tick: what came due meanwhile, in one frame
