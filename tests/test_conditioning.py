"""The conditioning stage driven directly: real anyio tasks, a bounded downstream edge."""

import time

import anyio
import numpy as np
import pytest
import structlog
import structlog.testing
from structlog.testing import capture_logs

from charstream.stages.base import StageContext
from charstream.stages.conditioning.stage import ConditioningStage, build
from charstream.stages.config import ConditioningConfig
from charstream.timeline import CHARACTERS
from charstream.transport.messages import (
    AgentAudio,
    ClockPayload,
    Conditioning,
    Control,
    ControlKind,
    RollbackPayload,
    TraceContext,
    TurnEvent,
    TurnKind,
)

LOOKAHEAD = 1920  # the tiny preset's 40 ms at 48 kHz
CONTEXT = 3840  # its 80 ms of left context
FRAME = 960  # 20 ms at 48 kHz, the adapters' frame


def stage(**options) -> ConditioningStage:
    """The runner's factory with the tiny preset's real audio encoder (seeded random weights)."""
    # Unless a test says otherwise, listening chunks are limited by credit alone (no idle lead).
    return build(ConditioningConfig(**{"idle_lead_chunks": None, **options}), "tiny", weights=None)


class Harness:
    """Runs the stage as the runner would: ``run`` as a task, ``process``/``control`` fed beside it."""

    def __init__(self, stage: ConditioningStage, capacity: int = 2):
        self.stage = stage
        self.send, self.receive = anyio.create_memory_object_stream[Conditioning](capacity)
        self.controls: list[Control] = []
        self.ctx = StageContext("conditioning", "sess", emit=self.send.send, send_control=self._control,
                                log=structlog.get_logger().bind(stage="conditioning"))

    async def _control(self, msg: Control) -> None:
        self.controls.append(msg)

    async def next(self, timeout: float = 2.0) -> Conditioning:
        with anyio.fail_after(timeout):
            return await self.receive.receive()

    async def of_epoch(self, epoch: int, count: int) -> list[Conditioning]:
        """The next ``count`` chunks of ``epoch``, passing over the others (stale ones still queued)."""
        chunks = []
        while len(chunks) < count:
            c = await self.next()
            if c.epoch == epoch:
                chunks.append(c)
        return chunks

    async def speech(self, turn_id: int, samples: np.ndarray, start: int = 0, pace_s: float = 0.0) -> None:
        for i in range(0, len(samples), FRAME):
            trace = TraceContext(turn_id, {"agent_first_audio": time.time()} if i == 0 else {})
            await self.stage.process(AgentAudio("sess", i // FRAME, samples[i:i + FRAME], start + i, trace=trace),
                                     self.ctx)
            if pace_s:
                await anyio.sleep(pace_s)


def tone(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(1000, 8000, n) * rng.choice([-1, 1], n)).astype(np.int16)


async def started(stage: ConditioningStage, tg, capacity: int = 2) -> Harness:
    h = Harness(stage, capacity)
    await stage.setup(h.ctx)
    tg.start_soon(stage.run, h.ctx)
    return h


@pytest.mark.anyio
async def test_listening_stream_is_continuous_and_bounded_by_credit():
    async with anyio.create_task_group() as tg:
        h = await started(stage(), tg, capacity=2)
        first = [await h.next() for _ in range(5)]
        assert [c.chunk for c in first] == [0, 1, 2, 3, 4]
        assert all(not c.speaking and c.trace.turn_id is None and not c.audio.any() for c in first)
        assert first[0].audio_tokens.shape == (4, 192) and first[0].audio_tokens.dtype == np.float32
        assert h.stage.lookahead == LOOKAHEAD and h.stage.context == CONTEXT
        await anyio.sleep(0.1)  # nobody reads: the stage must stop at the edge's capacity
        assert h.send.statistics().current_buffer_used == 2
        assert (await h.next()).chunk == 5
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_listening_chunks_are_paced_a_few_chunks_ahead_of_real_time():
    async with anyio.create_task_group() as tg:
        h = await started(stage(idle_lead_chunks=2), tg, capacity=64)
        await anyio.sleep(0.5)  # three chunks of media time
        early = h.send.statistics().current_buffer_used
        assert 4 <= early <= 7  # lead 2 + the chunks due by now (0, 1, 2, 3), not the edge's 64
        # A rollback re-anchors the schedule at the chunk on screen.
        await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=100, epoch=1), h.ctx)
        await anyio.sleep(0.2)
        fresh = []
        while h.send.statistics().current_buffer_used:
            c = await h.next()
            if c.epoch == 1:
                fresh.append(c.chunk)
        assert fresh[0] == 101 and 3 <= len(fresh) <= 5, fresh
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_turn_start_rollback_places_speech_at_the_first_uncommitted_chunk():
    speech = tone(int(2.3 * CHARACTERS.samples_per_chunk))
    first_ready = CHARACTERS.samples_per_chunk + LOOKAHEAD  # audio the first speaking chunk needs
    async with anyio.create_task_group() as tg:
        h = await started(stage(), tg)
        for expected in range(4):
            assert (await h.next()).chunk == expected
        # The agent's turn: the user's end of speech, then its reply streamed in 20 ms frames.
        await h.stage.process(TurnEvent("sess", 0, TurnKind.USER_SPEECH_END, 7, at=100.0), h.ctx)
        await h.speech(7, speech[:first_ready - FRAME], start=123_456)
        # Not enough for the first speaking chunk yet: no turn start, listening goes on meanwhile.
        assert h.controls == []
        listening = [await h.next() for _ in range(3)]
        assert all(not c.speaking and c.epoch == 0 for c in listening)
        await h.speech(7, speech[first_ready - FRAME:first_ready], start=123_456 + first_ready - FRAME)
        (turn_start,) = h.controls
        assert turn_start.kind == ControlKind.TURN_START and turn_start.trace.turn_id == 7
        assert turn_start.chunk >= 7 and turn_start.epoch == 0
        # At most the chunks already queued or built follow; then the stage holds for the rollback.
        stale = []
        for _ in range(2):
            await anyio.sleep(0.05)
            while h.send.statistics().current_buffer_used:
                stale.append(await h.next())
        assert len(stale) <= 3 and all(c.epoch == 0 and not c.speaking for c in stale)
        await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=2, epoch=1), h.ctx)
        await h.speech(7, speech[first_ready:], start=123_456 + first_ready)
        await h.stage.process(TurnEvent("sess", 1, TurnKind.AGENT_TURN_END, 7, at=time.time()), h.ctx)
        chunks = [await h.next() for _ in range(5)]
        assert [c.chunk for c in chunks] == [3, 4, 5, 6, 7] and all(c.epoch == 1 for c in chunks)
        assert [c.speaking for c in chunks] == [True, True, True, False, False]
        padded = np.zeros(3 * CHARACTERS.samples_per_chunk, np.int16)
        padded[:len(speech)] = speech
        assert np.array_equal(np.concatenate([c.audio for c in chunks[:3]]), padded)
        # Tokens are the encoding of the chunk's window: left context, its span, the look-ahead.
        timeline = np.concatenate([np.zeros(CONTEXT, np.int16), padded, np.zeros(LOOKAHEAD, np.int16)])
        for i, c in enumerate(chunks[:3]):
            window = timeline[i * CHARACTERS.samples_per_chunk:(i + 1) * CHARACTERS.samples_per_chunk + CONTEXT + LOOKAHEAD]
            assert np.allclose(c.audio_tokens, h.stage.encode(window), atol=1e-5)
        assert not np.allclose(chunks[1].audio_tokens, chunks[0].audio_tokens)
        # Only the first speaking chunk carries the turn's trace, in contract order.
        stamps = chunks[0].trace.stamps
        assert chunks[0].trace.turn_id == 7 and stamps["user_speech_end"] == 100.0
        assert stamps["agent_first_audio"] <= stamps["conditioning_ready"]
        assert all(set(c.trace.stamps) == {"conditioning_ready"} for c in chunks[1:])  # the latency playout measures
        assert [c.trace.turn_id for c in chunks] == [7, 7, 7, None, None]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_speaking_chunk_waits_for_its_span_and_look_ahead():
    speech = tone(3 * CHARACTERS.samples_per_chunk)
    second_ready = 2 * CHARACTERS.samples_per_chunk + LOOKAHEAD
    async with anyio.create_task_group() as tg:
        h = await started(stage(stall_s=5.0), tg, capacity=8)
        await h.speech(1, speech[:second_ready - FRAME])
        await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=-1, epoch=1), h.ctx)
        first = await h.next()
        while first.epoch != 1:
            first = await h.next()
        assert (first.chunk, first.speaking) == (0, True)
        assert np.array_equal(first.audio, speech[:CHARACTERS.samples_per_chunk])
        await anyio.sleep(0.1)  # 20 ms short of the second chunk's look-ahead: it must wait
        assert h.send.statistics().current_buffer_used == 0
        await h.speech(1, speech[second_ready - FRAME:second_ready], start=second_ready - FRAME)
        second = await h.next()
        assert (second.chunk, second.epoch, second.speaking) == (1, 1, True)
        assert np.array_equal(second.audio, speech[CHARACTERS.samples_per_chunk:2 * CHARACTERS.samples_per_chunk])
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_speech_starts_at_the_onset_frame_playout_chose_and_the_rewind_stays_within_the_ring():
    """The ROLLBACK's onset frame k: the first speaking chunk holds k silent frames, then the speech;
    its tokens encode exactly that window; the next chunks follow the speech without a gap. The turn
    start tells playout how far back a rewind is exact: rollback_frames (tiny: 4) behind the next chunk."""
    speech = tone(3 * CHARACTERS.samples_per_chunk)
    onset = 3
    async with anyio.create_task_group() as tg:
        h = await started(stage(idle_lead_chunks=8), tg, capacity=64)
        assert h.stage.idle_lead == h.stage.rollback_frames == 4  # the lead is capped at the ring's margin
        await h.next()  # listening has begun: the encoder is warm
        await h.speech(2, speech)
        (turn_start,) = h.controls
        assert turn_start.payload.earliest_chunk == turn_start.chunk - 4
        assert 0 < turn_start.payload.encode_s < 0.5 and turn_start.payload.last_emit_at <= time.time()
        due_at = time.time() + 0.5
        with structlog.testing.capture_logs() as logs:
            await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=1, epoch=1, payload=RollbackPayload(
                ControlKind.TURN_START, onset, dropped=0, kept=0, placed_at=time.time() - 0.02, due_at=due_at)), h.ctx)
        [heard] = [e for e in logs if e["event"] == "conditioning_rollback"]
        assert heard["onset_frame"] == onset and 20 <= heard["hop_ms"] < 500  # the placement's control, in transit
        await h.stage.process(TurnEvent("sess", 1, TurnKind.AGENT_TURN_END, 2, at=time.time()), h.ctx)
        chunks = await h.of_epoch(1, 5)
        assert [c.chunk for c in chunks] == [2, 3, 4, 5, 6] and [c.speaking for c in chunks] == [True] * 4 + [False]
        lead = onset * CHARACTERS.samples_per_frame
        timeline = np.concatenate([np.zeros(lead, np.int16), speech, np.zeros(2 * CHARACTERS.samples_per_chunk - lead, np.int16)])
        assert np.array_equal(np.concatenate([c.audio for c in chunks]), timeline)
        padded = np.concatenate([np.zeros(CONTEXT, np.int16), timeline, np.zeros(LOOKAHEAD, np.int16)])
        for i, c in enumerate(chunks[:4]):
            window = padded[i * CHARACTERS.samples_per_chunk:(i + 1) * CHARACTERS.samples_per_chunk + CONTEXT + LOOKAHEAD]
            assert np.allclose(c.audio_tokens, h.stage.encode(window), atol=1e-5)
        assert "agent_first_audio" in chunks[0].trace.stamps and chunks[0].trace.turn_id == 2
        # Listening resumes paced from playout's clock: chunk 2 was due at due_at, so chunk 6 leaves
        # no earlier than lead (4) chunks before its due time.
        assert h.stage._anchor[0] == 2
        assert abs(h.stage._anchor[1] - (time.monotonic() + due_at - time.time())) < 0.01
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_rollback_with_a_start_frame_rephases_the_chunks_and_starts_the_speech_there():
    """A chunk-motion model's ROLLBACK (``start_frame``): chunk ``c + 1`` starts at that media frame, the speech
    with it (no silent lead, whatever the onset frame), every later chunk a whole chunk after it, and each
    chunk says where it starts; a later rollback re-phases again."""
    speech = tone(2 * CHARACTERS.samples_per_chunk)
    frames = CHARACTERS.frames_per_chunk
    async with anyio.create_task_group() as tg:
        h = await started(stage(), tg, capacity=64)
        first = await h.next()
        assert first.start_frame == first.chunk * frames  # an unshifted grid
        await h.speech(2, speech)
        await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=1, epoch=1, payload=RollbackPayload(
            ControlKind.TURN_START, 3, dropped=0, kept=0, start_frame=2 * frames + 3)), h.ctx)
        await h.stage.process(TurnEvent("sess", 1, TurnKind.AGENT_TURN_END, 2, at=time.time()), h.ctx)
        chunks = await h.of_epoch(1, 3)
        assert [(c.chunk, c.start_frame, c.speaking) for c in chunks] == [(2, 11, True), (3, 15, True), (4, 19, False)]
        assert np.array_equal(np.concatenate([c.audio for c in chunks[:2]]), speech)
        padded = np.concatenate([np.zeros(CONTEXT, np.int16), speech, np.zeros(CHARACTERS.samples_per_chunk + LOOKAHEAD, np.int16)])
        assert np.allclose(chunks[1].audio_tokens, h.stage.encode(padded[CHARACTERS.samples_per_chunk:][
            :CONTEXT + CHARACTERS.samples_per_chunk + LOOKAHEAD]), atol=1e-5)
        await h.stage.control(Control("sess", 2, ControlKind.ROLLBACK, chunk=6, epoch=2, payload=RollbackPayload(
            ControlKind.INTERRUPT, 0, dropped=1, kept=0, start_frame=7 * frames + 1)), h.ctx)
        after = await h.of_epoch(2, 2)
        assert [(c.chunk, c.start_frame) for c in after] == [(7, 29), (8, 33)]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_turn_start_estimates_its_encode_from_turns_first_encodes_only():
    """The encode a turn start reports is the longest of recent turns' first speaking chunks' encodes: the
    slower encodes of a turn's later chunks (here 0.3 s) do not delay the next turn's placement."""
    speech = tone(3 * CHARACTERS.samples_per_chunk)
    async with anyio.create_task_group() as tg:
        h = await started(stage(), tg, capacity=64)
        await h.next()  # the warm-up's encodes are done
        encode, slow, slowed = h.stage.encode, [], []

        def timed(window: np.ndarray) -> np.ndarray:
            if slow:
                time.sleep(0.3)
                slowed.append(window)
            return encode(window)

        h.stage.encode = timed
        await h.speech(1, speech)
        (first_start,) = h.controls
        await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=first_start.chunk - 1, epoch=1,
                                      payload=RollbackPayload(ControlKind.TURN_START, 0, dropped=0, kept=0)), h.ctx)
        await h.stage.process(TurnEvent("sess", 1, TurnKind.AGENT_TURN_END, 2, at=time.time()), h.ctx)
        (first,) = await h.of_epoch(1, 1)
        assert first.speaking
        slow.append(True)  # the turn's later chunks encode slowly
        later = await h.of_epoch(1, 2)
        assert [c.speaking for c in later] == [True, True]
        assert len(slowed) >= 2  # both later chunks' encodes took 0.3 s
        await h.speech(2, speech)
        second_start = h.controls[-1]
        assert second_start is not first_start and second_start.payload.encode_s < 0.2, second_start.payload
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_while_the_first_chunk_gathers_listening_goes_just_in_time():
    """From the agent's first audio to the turn start, listening chunks leave one chunk ahead of their
    due time instead of the idle lead: the step is idle when the speech comes."""
    async with anyio.create_task_group() as tg:
        h = await started(stage(idle_lead_chunks=4), tg, capacity=64)
        with anyio.fail_after(5):  # the encoder is warm once listening begins
            while not h.send.statistics().current_buffer_used:
                await anyio.sleep(0.01)
        await h.stage.control(Control("sess", 1, ControlKind.CLOCK, chunk=0, payload=ClockPayload(time.time())), h.ctx)
        await anyio.sleep(0.05)
        assert h.send.statistics().current_buffer_used == 5  # chunks 0..4: four ahead of chunk 0 on screen
        await h.speech(3, tone(FRAME))  # the turn's first 20 ms
        await anyio.sleep(0.4)  # with the idle lead, chunks 5 and 6 would have left (at 0.17 and 0.33 s)
        assert h.send.statistics().current_buffer_used == 5 and h.controls == []  # chunk 5 is due at 0.83 s: not yet
        await h.speech(3, tone(CHARACTERS.samples_per_chunk + LOOKAHEAD), start=FRAME)
        assert [c.kind for c in h.controls] == [ControlKind.TURN_START]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_barge_in_returns_to_listening_at_the_next_chunk_and_drops_late_speech():
    speech = tone(6 * CHARACTERS.samples_per_chunk)
    async with anyio.create_task_group() as tg:
        h = await started(stage(), tg)
        await h.speech(2, speech[:4 * CHARACTERS.samples_per_chunk])
        await h.stage.control(Control("sess", 1, ControlKind.ROLLBACK, chunk=0, epoch=1), h.ctx)
        spoken = await h.of_epoch(1, 2)
        assert [(c.chunk, c.speaking) for c in spoken] == [(1, True), (2, True)]
        # The user talks over the character: ingest interrupts, playout rolls back to the chunk on screen.
        await h.stage.process(TurnEvent("sess", 2, TurnKind.INTERRUPT, 2, at=time.time()), h.ctx)
        await h.speech(2, speech[4 * CHARACTERS.samples_per_chunk:], start=4 * CHARACTERS.samples_per_chunk)  # arrives too late
        await h.stage.control(Control("sess", 2, ControlKind.ROLLBACK, chunk=1, epoch=2), h.ctx)
        after = await h.of_epoch(2, 4)
        assert [c.chunk for c in after] == [2, 3, 4, 5]
        assert not any(c.speaking or c.audio.any() for c in after)
        assert len(h.controls) == 1  # the late audio of the interrupted turn started nothing
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_bad_input_is_logged_with_the_turn_and_listening_continues():
    async with anyio.create_task_group() as tg:
        h = await started(stage(), tg)
        with capture_logs() as logs:
            await h.stage.process(AgentAudio("sess", 0, np.zeros(441, np.int16), 0, sample_rate=22_050,
                                             trace=TraceContext(4)), h.ctx)
            await h.stage.process(AgentAudio("sess", 1, np.full(960, np.nan, np.float32), 0,
                                             trace=TraceContext(4)), h.ctx)
            await h.stage.process(AgentAudio("sess", 2, np.zeros(960, np.int16), 0), h.ctx)
            await h.stage.process(TurnEvent("sess", 3, TurnKind.AGENT_TURN_END, 9, at=0.0), h.ctx)
            # A turn announced and ended without any audio is no error, and starts nothing.
            await h.stage.process(TurnEvent("sess", 4, TurnKind.AGENT_TURN_START, 10, at=0.0), h.ctx)
            await h.stage.process(TurnEvent("sess", 5, TurnKind.AGENT_TURN_END, 10, at=0.0), h.ctx)
        errors = [e for e in logs if e["log_level"] == "error"]
        assert [e["turn_id"] for e in errors] == [4, 4, None, 9]
        assert "22050 Hz" in errors[0]["problem"] and "int16" in errors[1]["problem"]
        assert "without a start" in errors[3]["problem"]
        assert h.stage.errors == 4 and h.controls == []  # nothing was taken for speech
        chunks = [await h.next() for _ in range(4)]
        assert [c.chunk for c in chunks] == [0, 1, 2, 3] and not any(c.speaking for c in chunks)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_an_agent_that_stops_mid_turn_is_ended_and_no_rollback_answer_still_places_speech():
    speech = tone(int(1.5 * CHARACTERS.samples_per_chunk))
    async with anyio.create_task_group() as tg:
        h = await started(stage(rollback_wait_s=0.1, stall_s=0.3), tg,
                          capacity=16)
        await anyio.sleep(0.05)
        with capture_logs() as logs:
            await h.speech(3, speech)  # then silence from the agent: no more audio, no turn end
            t0 = time.monotonic()
            spoken = []
            while len(spoken) < 2:
                c = await h.next()
                if c.speaking:
                    spoken.append(c)
            waited = time.monotonic() - t0
            after = await h.next()
        assert waited >= 0.3  # the partial second chunk waited for the stall window
        assert spoken[1].chunk == spoken[0].chunk + 1 and not after.speaking
        assert np.array_equal(spoken[1].audio[:len(speech) - CHARACTERS.samples_per_chunk], speech[CHARACTERS.samples_per_chunk:])
        assert not spoken[1].audio[len(speech) - CHARACTERS.samples_per_chunk:].any()
        events = [e["event"] for e in logs]
        assert any("no rollback answer" in e for e in events)
        assert any("stalled" in e.get("problem", "") and e["turn_id"] == 3 for e in logs)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_sessions_sharing_an_encode_batcher_get_their_own_tokens_from_one_batch():
    """Two sessions' conditioning stages on the process's encode batcher: their windows are encoded in one
    batch, each gets what its own encode makes, and a stage's teardown leaves the batcher."""
    from charstream.model.families.base import AudioConditioner
    from charstream.stages.conditioning.batcher import EncodeBatcher

    alone = stage()
    sizes: list[int] = []

    def encode_batch(windows: list[np.ndarray]) -> list[np.ndarray]:
        sizes.append(len(windows))
        return [alone.encode(w) for w in windows]

    conditioner = AudioConditioner(alone.encode, CONTEXT / 48, LOOKAHEAD / 48, encode_batch=encode_batch)
    batcher = EncodeBatcher(ConditioningConfig(batch_sessions=2, batch_window_s=1.0), conditioner, CHARACTERS)
    window = CONTEXT + CHARACTERS.samples_per_chunk + LOOKAHEAD
    assert batcher.window_samples == window
    config = ConditioningConfig(idle_lead_chunks=None)
    stages = [build(config, "tiny", weights=None, batcher=batcher) for _ in range(2)]
    async with anyio.create_task_group() as tg:
        harnesses = [await started(s, tg) for s in stages]
        firsts = [await h.next() for h in harnesses]
        tg.cancel_scope.cancel()
    for s in stages:
        await s.teardown()
    silence = np.zeros(window, np.int16)
    for c in firsts:
        assert c.chunk == 0 and np.array_equal(c.audio_tokens, alone.encode(silence))
    assert sizes[0] == 2 and batcher.stats.largest == 2
    assert batcher._open == 0  # both sessions left: its worker ends
    # a window the batch cannot take fails its own session, before the batch
    with pytest.raises(ValueError, match=f"{window} int16 samples"):
        batcher.check(None, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        batcher.check(None, np.zeros(4, np.int16))
    with pytest.raises(ValueError, match="one window at a time"):  # a family without encode_batch
        EncodeBatcher(ConditioningConfig(batch_sessions=2), AudioConditioner(alone.encode, 0.0, 0.0), CHARACTERS)


@pytest.fixture
def anyio_backend():
    return "asyncio"
