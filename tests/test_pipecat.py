"""The Pipecat avatar service in a real Pipecat pipeline (PipelineWorker + WorkerRunner) in front of a
real charstream session, its output going through Pipecat's real ``SmallWebRTCTransport`` to an
aiortc peer on loopback: the transport's own bookkeeping (BotStarted/StoppedSpeaking) sees the
character speak, turns complete with Pipecat's latency observer agreeing, user speech alone
interrupts nothing, an InterruptionFrame stops the character, a session that cannot start is fatal."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest

pytest.importorskip("pipecat", reason="extra 'pipecat' not installed (make test installs it)")

from aiortc import RTCPeerConnection, RTCSessionDescription  # noqa: E402
from pipecat.audio.utils import is_silence  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    EndFrame,
    ErrorFrame,
    InterruptionFrame,
    SpeechOutputAudioRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed  # noqa: E402
from pipecat.observers.user_bot_latency_observer import UserBotLatencyObserver  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.transports.base_transport import TransportParams  # noqa: E402
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection  # noqa: E402
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402
from waiting import until  # noqa: E402

from charstream.model.config import get_preset  # noqa: E402
from charstream.pipeline.config import PipelineConfig  # noqa: E402
from charstream.pipeline.integrations.embedded import EmbeddedSession  # noqa: E402
from charstream.pipeline.integrations.pipecat import CharstreamVideoService  # noqa: E402
from charstream.stages.agents.tts import synthesize  # noqa: E402

FIRST = "Hello, I am speaking through Pipecat."
SECOND = "This second sentence is long, and it will be interrupted before it can finish at all."
VAD_STOP_SECS = 0.2
CHUNK_S = 0.04  # the output transport's audio chunks (TransportParams.audio_out_10ms_chunks = 4)


class Recorder(BaseObserver):
    """What the output transport sends (its audio chunks) and its bot-speaking frames, in the order it
    pushes them (an observer: a processor after it would see its system frames jump the queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.transport = None
        self.events: list[tuple[float, str]] = []  # (time, "speech" | "quiet" | "silence" | "started" | "stopped")

    async def on_push_frame(self, data: FramePushed) -> None:
        frame = data.frame
        if data.source is not self.transport or data.direction != FrameDirection.DOWNSTREAM:
            return
        if isinstance(frame, SpeechOutputAudioRawFrame):
            # "speech" as the transport judges it (is_silence: a level threshold); "quiet": sound under it
            if not is_silence(frame.audio):
                kind = "speech"
            else:
                kind = "quiet" if np.frombuffer(frame.audio, np.int16).any() else "silence"
            self.events.append((time.time(), kind))
        elif isinstance(frame, BotStartedSpeakingFrame):
            self.events.append((time.time(), "started"))
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self.events.append((time.time(), "stopped"))

    def count(self, kind: str, start: int = 0) -> int:
        return sum(1 for _, k in self.events[start:] if k == kind)


class ErrorCatcher(FrameProcessor):
    """First in the pipeline: error frames travel upstream to it."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[ErrorFrame] = []

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        await self.push_frame(frame, direction)


def _tts_frames(text: str) -> tuple[list[TTSAudioRawFrame], float]:
    speech = synthesize(text, "en+f3")
    step = speech.sample_rate // 50  # 20 ms, as a Pipecat TTS service pushes them
    frames = [TTSAudioRawFrame(audio=speech.samples[i:i + step].tobytes(), sample_rate=speech.sample_rate,
                               num_channels=1) for i in range(0, len(speech.samples), step)]
    return frames, speech.duration


async def _webrtc_peer() -> tuple[RTCPeerConnection, SmallWebRTCConnection, list]:
    """An aiortc peer on loopback, offering to receive audio and video, and the bot's connection."""
    client = RTCPeerConnection()
    received: list = []
    client.addTransceiver("audio", direction="recvonly")
    client.addTransceiver("video", direction="recvonly")
    client.createDataChannel("chat")

    @client.on("track")
    def on_track(track):
        async def pull():
            while True:
                received.append((track.kind, await track.recv()))
        asyncio.ensure_future(pull())

    await client.setLocalDescription(await client.createOffer())
    bot = SmallWebRTCConnection()
    await bot.initialize(sdp=client.localDescription.sdp, type=client.localDescription.type)
    answer = bot.get_answer()
    await client.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
    return client, bot, received


@pytest.fixture(scope="module")
def pipecat_run():
    config = PipelineConfig()
    config.ingest.adapter = "pipecat"
    model = get_preset(config.preset)
    first, first_s = _tts_frames(FIRST)
    second, second_s = _tts_frames(SECOND)
    recorder, catcher = Recorder(), ErrorCatcher()
    latencies: list[float] = []
    marks: dict = {"first_s": first_s, "second_s": second_s}

    def last(kind: str) -> int:
        return max((i for i, (_, k) in enumerate(recorder.events) if k == kind), default=-1)

    def sounded(start: int) -> int:
        return recorder.count("speech", start) + recorder.count("quiet", start)

    async def listen_for(seconds: float) -> None:
        """Until the transport has sent this much silence from now on (counted, not timed: a loaded
        machine sends it late, not less of it)."""
        start = len(recorder.events)
        assert await until(lambda: recorder.count("silence", start) >= seconds / CHUNK_S, 60), "no silence sent"

    async def settle() -> None:
        """Until the transport says the bot stopped after its last speech, then a second of silence. Speech
        as the transport judges it: a sub-threshold ("quiet") chunk arriving 0.35 s after the last speech is
        silence to it, and it pushes that chunk after the BotStoppedSpeakingFrame it triggered."""
        assert await until(lambda: last("stopped") > last("speech"), 60), (
            "no BotStoppedSpeakingFrame after the speech", recorder.events[-40:])
        await listen_for(1.0)

    async def conversation(worker, service):
        assert await until(lambda: recorder.count("silence") >= 1 / CHUNK_S, 120), "no frames reached the transport"
        await listen_for(1.0)  # idle, listening: no bot speech
        marks["reply1"] = len(recorder.events)
        # the user's turn, as Pipecat's VAD and turn strategy report it, then the bot's answer
        await worker.queue_frames([UserStartedSpeakingFrame(),
                                   VADUserStoppedSpeakingFrame(stop_secs=VAD_STOP_SECS, timestamp=time.time()),
                                   UserStoppedSpeakingFrame(),
                                   TTSStartedFrame(), *first, TTSStoppedFrame()])
        await until(lambda: recorder.count("speech", marks["reply1"]) > 0, 60)
        # the user speaks over the bot; the pipeline's strategies do not interrupt (no InterruptionFrame)
        await worker.queue_frames([UserStartedSpeakingFrame(), UserStoppedSpeakingFrame()])
        await until(lambda: sounded(marks["reply1"]) >= (first_s - 0.4) / CHUNK_S, 60)  # heard in full (asserted)
        await settle()
        marks["idle2"] = len(recorder.events)
        await listen_for(1.0)
        marks["reply2"] = len(recorder.events)
        await worker.queue_frames([TTSStartedFrame(), *second, TTSStoppedFrame()])
        await until(lambda: recorder.count("speech", marks["reply2"]) >= 1 / CHUNK_S, 60)  # a second into the reply
        marks["interrupt"] = len(recorder.events)
        await worker.queue_frame(InterruptionFrame())
        await settle()
        marks["records"] = list(service._session.live.tracer.records)
        await worker.queue_frame(EndFrame())

    async def main():  # Pipecat's runner belongs to a running loop: build everything inside it
        client, connection, received = await _webrtc_peer()
        transport = SmallWebRTCTransport(connection, TransportParams(
            audio_out_enabled=True, audio_out_sample_rate=48_000, video_out_enabled=True,
            video_out_width=model.width, video_out_height=model.height, video_out_framerate=24))
        service = CharstreamVideoService(EmbeddedSession(config, "pipecat-test"))
        observer = UserBotLatencyObserver()

        @observer.event_handler("on_latency_measured")
        async def on_latency(_observer, seconds):
            latencies.append(seconds)

        recorder.transport = transport.output()
        worker = PipelineWorker(Pipeline([catcher, service, recorder.transport]),
                                params=PipelineParams(), observers=[observer, recorder], enable_rtvi=False,
                                idle_timeout_secs=None)
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        running = asyncio.ensure_future(runner.run())
        try:
            await asyncio.wait_for(conversation(worker, service), 200)
            await asyncio.wait_for(running, 60)
        finally:  # a failed conversation must not leave the runner holding the loop open
            if not running.done():
                await worker.cancel(reason="the test failed")
                await asyncio.wait_for(running, 30)
            await client.close()
        marks["received"] = {kind: sum(1 for k, _ in received if k == kind) for kind in ("audio", "video")}

    asyncio.run(main())
    return recorder, catcher, latencies, marks


def _kinds(recorder: Recorder, start: int, end: int | None = None) -> list[str]:
    return [k for _, k in recorder.events[start:end]]


def test_the_transport_sees_the_character_speak_around_each_reply_and_never_while_idle(pipecat_run):
    recorder, catcher, _, marks = pipecat_run
    assert not catcher.errors
    idle = _kinds(recorder, 0, marks["reply1"]) + _kinds(recorder, marks["idle2"], marks["reply2"])
    assert idle.count("silence") * CHUNK_S >= 2 and not {"speech", "quiet", "started", "stopped"} & set(idle)
    for start, end, interrupted in ((marks["reply1"], marks["idle2"], False), (marks["reply2"], None, True)):
        reply = _kinds(recorder, start, end)
        first_speech, last_speech = reply.index("speech"), len(reply) - 1 - reply[::-1].index("speech")
        assert "started" in reply[:first_speech + 2]  # as the first speech is sent (it emits right after)
        states = [k for k in reply if k in ("started", "stopped")]
        assert states[-1] == "stopped" and states.count("started") == states.count("stopped"), states
        if not interrupted:  # BOT_VAD_STOP_SECS after the last speech (an interruption stops it at once,
            # while the chunk being written still goes out)
            assert "stopped" in reply[last_speech:], reply[last_speech - 5:last_speech + 30]
    assert marks["received"]["audio"] > 100 and marks["received"]["video"] > 24  # the peer got media


def test_user_speech_alone_does_not_interrupt_the_reply(pipecat_run):
    recorder, _, _, marks = pipecat_run
    spoken = sum(recorder.count(k, marks["reply1"]) - recorder.count(k, marks["idle2"]) for k in ("speech", "quiet"))
    assert spoken * CHUNK_S == pytest.approx(marks["first_s"], abs=0.4)


def test_interruption_frame_stops_the_character(pipecat_run):
    recorder, _, _, marks = pipecat_run
    after = _kinds(recorder, marks["interrupt"])
    # what was already on its way out (playout depth + one chunk: 16 frames) may still play
    assert (after.count("speech") + after.count("quiet")) * CHUNK_S <= 16 / 24 + 0.1
    assert recorder.count("speech", marks["reply2"]) * CHUNK_S < marks["second_s"] - 1.0


def test_embedded_turns_complete_and_pipecat_latency_agrees(pipecat_run):
    _, _, latencies, marks = pipecat_run
    answered = next(r for r in marks["records"] if "user_speech_end" in r.stamps)
    assert answered.complete, sorted(answered.stamps)
    data = answered.to_json()
    assert data["in_order"] and data["segments"]["delivery"] >= 0
    # Pipecat's UserBotLatencyObserver: VAD stop (back-dated by stop_secs) to BotStartedSpeaking
    assert latencies, "Pipecat measured no user-to-bot latency"
    assert data["segments"]["total"] == pytest.approx(latencies[0], abs=0.05)


def test_a_session_that_cannot_start_ends_the_pipeline_saying_why(tmp_path):
    config = PipelineConfig()
    config.ingest.adapter = "pipecat"
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not weights")
    catcher = ErrorCatcher()

    async def main():
        service = CharstreamVideoService(EmbeddedSession(config, "pipecat-broken", weights=str(broken)))
        worker = PipelineWorker(Pipeline([catcher, service]), params=PipelineParams(), enable_rtvi=False,
                                idle_timeout_secs=None)
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        await asyncio.wait_for(runner.run(), 60)  # ends by itself: nobody sends an EndFrame

    asyncio.run(main())
    (error,) = catcher.errors
    assert "did not start" in error.error and "SafetensorError" in error.error, error.error
    assert not error.processor.is_usable


def test_the_example_runs_to_completion_and_writes_the_character(tmp_path):
    out = tmp_path / "pipecat-avatar.mp4"
    example = Path(__file__).resolve().parents[1] / "examples" / "pipecat_avatar.py"
    done = subprocess.run([sys.executable, str(example), "--line", "Hello from Pipecat.", "--out", str(out),
                           "--seconds-after", "0.5"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote" in done.stdout
    with av.open(str(out)) as container:
        video = sum(1 for _ in container.decode(video=0))
    with av.open(str(out)) as container:
        audio = np.concatenate([f.to_ndarray().ravel() for f in container.decode(audio=0)])
    assert video > 24 and np.abs(audio).max() > 0.01  # the character's frames and its speech
