"""The LiveKit Agents VideoGenerator over a real charstream session, driven by LiveKit's real
``AvatarRunner`` with the agent side's real ``QueueAudioOutput`` and the runner's real
``AVSynchronizer`` (audio and video sources through LiveKit's native library), in a stand-in room
(no LiveKit server): LiveKit's own playback events must tell the truth — playback starts at the
speech, the position is the speech's duration within one frame, the segment ends when the speech
does, and clear_buffer reports an interrupted playback at the position actually heard."""

import asyncio
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("livekit.agents", reason="extra 'livekit' not installed (make test installs it)")

from livekit import rtc  # noqa: E402
from livekit.agents.voice.avatar import (  # noqa: E402
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    QueueAudioOutput,
)
from waiting import until  # noqa: E402

from charstream.model.config import get_preset  # noqa: E402
from charstream.pipeline.config import PipelineConfig  # noqa: E402
from charstream.pipeline.integrations.embedded import EmbeddedSession  # noqa: E402
from charstream.pipeline.integrations.livekit import CharstreamVideoGenerator, serve_avatar  # noqa: E402
from charstream.stages.agents.tts import synthesize  # noqa: E402
from charstream.stages.ingest.resample import resample, to_int16  # noqa: E402
from charstream.timeline import VIDEO_FPS  # noqa: E402

RATE = 24_000  # what LiveKit TTS plugins commonly produce
FRAME_S = 1 / VIDEO_FPS
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "livekit_avatar.py"


class StandInPublication:
    async def wait_for_subscription(self) -> None:
        pass


class StandInParticipant:
    def __init__(self) -> None:
        self.published: list = []

    async def publish_track(self, track, options) -> StandInPublication:
        self.published.append(track)
        return StandInPublication()


class StandInRoom(rtc.EventEmitter):
    """What AvatarRunner uses of an ``rtc.Room``: connected, events, publishing."""

    name = "stand-in"

    def __init__(self) -> None:
        super().__init__()
        self.local_participant = StandInParticipant()
        self.connected = True

    def isconnected(self) -> bool:
        return self.connected


class Tapped(CharstreamVideoGenerator):
    """Records what the generator hands the runner, as the runner takes it."""

    def __init__(self, session) -> None:
        super().__init__(session)
        self.out: list[tuple[float, object]] = []

    def __aiter__(self):
        return self._tap()

    async def _tap(self):
        async for item in self._frames():
            self.out.append((time.time(), item))
            yield item


def _frames(text: str) -> tuple[list[rtc.AudioFrame], float]:
    speech = synthesize(text, "en+f3")
    pcm = to_int16(resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, RATE))
    step = RATE // 100  # 10 ms frames, as LiveKit's audio pipeline carries them
    frames = [rtc.AudioFrame(pcm[i:i + step].tobytes(), RATE, 1, len(pcm[i:i + step]))
              for i in range(0, len(pcm), step)]
    voiced = np.flatnonzero(pcm)
    return frames, (voiced[-1] + 1 - voiced[0]) / RATE  # the speech: exact zeros around it are not heard


def _audio(items) -> list[np.ndarray]:
    return [np.frombuffer(f.data, np.int16) for _, f in items if isinstance(f, rtc.AudioFrame)]


@pytest.fixture(scope="module")
def livekit_run():
    events: list[tuple[float, str, object]] = []
    marks: dict = {}

    async def main():
        config = PipelineConfig()
        config.ingest.adapter = "livekit"
        model = get_preset(config.preset)
        session = EmbeddedSession(config, "livekit-test")
        generator = Tapped(session)
        agent_audio = QueueAudioOutput(wait_playback_start=True)  # the runner says when playback starts
        agent_audio.on("playback_started", lambda ev: events.append((time.time(), "started", ev)))
        agent_audio.on("playback_finished", lambda ev: events.append((time.time(), "finished", ev)))
        room = StandInRoom()
        runner = AvatarRunner(room, audio_recv=agent_audio, video_gen=generator,
                              options=AvatarOptions(video_width=model.width, video_height=model.height,
                                                    video_fps=VIDEO_FPS, audio_sample_rate=48_000, audio_channels=1))
        await session.start()
        await runner.start()
        out = generator.out
        try:
            await until(lambda: len(out) >= 2 * VIDEO_FPS, 120)  # two seconds of listening frames
            marks["idle"] = len(out)
            first, marks["first_s"] = _frames("Hello from a LiveKit agent.")
            for frame in first:  # the agent's TTS: faster than real time
                await agent_audio.capture_frame(frame)
            agent_audio.flush()
            await until(lambda: sum(k == "finished" for _, k, _ in events) == 1, 90)
            await asyncio.sleep(0.5)  # listening again
            marks["second_start"] = len(out)
            second, marks["second_s"] = _frames("This is a much longer answer that the user will cut short very soon.")

            async def speak():
                for frame in second:  # bounded queues: the push runs about as far ahead as the pipeline lets it
                    await agent_audio.capture_frame(frame)

            speaking = asyncio.create_task(speak())
            await until(lambda: len(_audio(out[marks["second_start"]:])) >= VIDEO_FPS, 60)  # a second heard
            speaking.cancel()  # the agent stops its TTS and clears the avatar's buffer (user interrupted)
            await asyncio.gather(speaking, return_exceptions=True)
            marks["clear"] = len(out)
            agent_audio.clear_buffer()
            await until(lambda: sum(k == "finished" for _, k, _ in events) == 2, 30)
            marks["cleared"] = len(out)
            await asyncio.sleep(1.0)  # listening after the interruption
        finally:
            await runner.aclose()
            await session.stop()
        marks["published"] = len(room.local_participant.published)
        marks["out"] = list(generator.out)

    asyncio.run(main())
    return events, marks


def test_frames_are_video_always_audio_only_while_speaking(livekit_run):
    _, marks = livekit_run
    out = marks["out"]
    videos = [f for _, f in out if isinstance(f, rtc.VideoFrame)]
    assert len(videos) > VIDEO_FPS * 4 and len({(v.width, v.height) for v in videos}) == 1
    assert all(v.type == rtc.VideoBufferType.RGB24 for v in videos)
    audios = [f for _, f in out if isinstance(f, rtc.AudioFrame)]
    assert all(a.sample_rate == 48_000 and a.samples_per_channel == 2_000 and a.num_channels == 1 for a in audios)
    assert not _audio(out[:marks["idle"]])  # listening: no audio frames, so no playback position
    assert marks["published"] == 2  # the runner published its audio and video tracks


def test_playback_starts_at_the_speech_and_its_position_is_the_speech_duration(livekit_run):
    events, marks = livekit_run
    out = marks["out"]
    started = [(t, ev) for t, kind, ev in events if kind == "started"]
    finished = [(t, ev) for t, kind, ev in events if kind == "finished"]
    assert len(started) == 2 and len(finished) == 2  # one per segment: none while idle, none twice
    (first_at, first_audio), (second_at, _) = [(t, f) for t, f in out if isinstance(f, rtc.AudioFrame)][:2]
    assert np.frombuffer(first_audio.data, np.int16).any()  # the first counted frame is speech
    assert first_at <= started[0][0] <= second_at  # reported for that very frame
    ev = finished[0][1]
    assert not ev.interrupted
    assert ev.playback_position == pytest.approx(marks["first_s"], abs=FRAME_S)


def test_the_segment_ends_when_its_speech_ends(livekit_run):
    _, marks = livekit_run
    first = marks["out"][:marks["second_start"]]
    end = next(i for i, (_, f) in enumerate(first) if isinstance(f, AudioSegmentEnd))
    last_audio = max(i for i, (_, f) in enumerate(first) if isinstance(f, rtc.AudioFrame))
    assert end == last_audio + 1  # right after the frame that holds the last of the speech
    assert np.frombuffer(first[last_audio][1].data, np.int16).any()
    assert not _audio(first[end:])


def test_clear_buffer_reports_the_interrupted_position(livekit_run):
    events, marks = livekit_run
    _, ev = [(t, ev) for t, kind, ev in events if kind == "finished"][1]
    out = marks["out"]
    heard = len(_audio(out[marks["second_start"]:])) * FRAME_S
    assert ev.interrupted
    assert ev.playback_position == pytest.approx(heard, abs=1e-6)  # exactly what was heard
    assert len(_audio(out[marks["clear"]:])) <= 2  # the runner hands the clear on at its next await
    assert ev.playback_position < marks["second_s"] - 1.0
    assert not _audio(marks["out"][marks["cleared"]:])  # no more of it counts, or plays


def test_the_avatar_worker_exits_when_the_room_goes():
    spec = importlib.util.spec_from_file_location("livekit_avatar", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # the example script's worker is serve_avatar

    async def main():
        room = StandInRoom()
        task = asyncio.create_task(example.serve_avatar(room, QueueAudioOutput(), PipelineConfig(), "gone"))
        await asyncio.sleep(0.5)  # starting (or serving): the room may go at any time
        assert not task.done()
        room.connected = False
        room.emit("disconnected", "room deleted")
        return await asyncio.wait_for(task, 60)

    assert asyncio.run(main()) == "room disconnected: room deleted"


def test_the_agent_side_plugin_mints_the_avatar_token_and_says_why_it_cannot_join(monkeypatch):
    from livekit import api
    from livekit.agents import AgentSession
    from livekit.agents.types import ATTRIBUTE_PUBLISH_ON_BEHALF

    from charstream.pipeline.integrations.livekit_plugin import AvatarSession

    for name in ("LIVEKIT_URL", "LIVEKIT_API_KEY", "LIVEKIT_API_SECRET"):
        monkeypatch.delenv(name, raising=False)
    room = StandInRoom()
    room.local_participant.identity = "agent-7"
    avatar = AvatarSession(avatar_participant_identity="face-1")
    assert (avatar.avatar_identity, avatar.provider) == ("face-1", "charstream")
    claims = api.TokenVerifier("key", "secret-that-is-long-enough-for-hs256").verify(
        avatar.token(room, "key", "secret-that-is-long-enough-for-hs256"))
    assert claims.identity == "face-1" and claims.video.room == "stand-in" and claims.video.room_join
    assert claims.attributes == {ATTRIBUTE_PUBLISH_ON_BEHALF: "agent-7"}

    async def main():
        agent = AgentSession()
        with pytest.raises(ValueError, match="LIVEKIT_URL"):
            await AvatarSession().start(agent, room, livekit_url="")
        with pytest.raises(RuntimeError, match="could not join room 'stand-in' at ws://127.0.0.1:9"):
            await avatar.start(agent, room, livekit_url="ws://127.0.0.1:9", livekit_api_key="key",
                               livekit_api_secret="secret-that-is-long-enough-for-hs256")
        assert agent.output.audio is None  # the agent keeps its own audio output
        await avatar.aclose()

    asyncio.run(main())


def test_the_avatar_worker_exits_when_its_agent_leaves():
    class Leaving:
        def __init__(self, identity: str) -> None:
            self.identity = identity

    async def main():
        room = StandInRoom()
        task = asyncio.create_task(serve_avatar(room, QueueAudioOutput(), PipelineConfig(), "left", "agent-1"))
        await asyncio.sleep(0.5)
        room.emit("participant_disconnected", Leaving("a-viewer"))  # someone else: the avatar stays
        await asyncio.sleep(0.2)
        assert not task.done()
        room.emit("participant_disconnected", Leaving("agent-1"))
        return await asyncio.wait_for(task, 60)

    assert asyncio.run(main()) == "agent agent-1 left"
