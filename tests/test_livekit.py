"""The LiveKit Agents VideoGenerator over a real charstream session, at the interface AvatarRunner
uses: push_audio (rtc.AudioFrame, AudioSegmentEnd), clear_buffer, and async iteration of
rtc.VideoFrame / rtc.AudioFrame / AudioSegmentEnd."""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("livekit.agents", reason="extra 'livekit' not installed (make test installs it)")

from charstream.pipeline.config import PipelineConfig  # noqa: E402
from charstream.pipeline.integrations.avatar_session import AvatarSession  # noqa: E402
from charstream.pipeline.integrations.livekit import CharstreamVideoGenerator  # noqa: E402
from charstream.stages.ingest.resample import resample, to_int16  # noqa: E402
from charstream.stages.ingest.tts import synthesize  # noqa: E402
from livekit import rtc  # noqa: E402
from livekit.agents.voice.avatar import AudioSegmentEnd, VideoGenerator  # noqa: E402
from waiting import until  # noqa: E402

RATE = 24_000  # what LiveKit TTS plugins commonly produce


def _frames(text: str) -> tuple[list[rtc.AudioFrame], float]:
    speech = synthesize(text, "en+f3")
    pcm = to_int16(resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, RATE))
    step = RATE // 100  # 10 ms frames, as LiveKit's audio pipeline carries them
    frames = [rtc.AudioFrame(pcm[i:i + step].tobytes(), RATE, 1, len(pcm[i:i + step]))
              for i in range(0, len(pcm), step)]
    return frames, len(pcm) / RATE


@pytest.fixture(scope="module")
def livekit_run():
    out: list = []  # (wall time, item)
    marks = {}

    async def main():
        config = PipelineConfig()
        config.ingest.adapter = "livekit"
        session = AvatarSession(config, "livekit-test")
        generator = CharstreamVideoGenerator(session)
        assert isinstance(generator, VideoGenerator)
        await session.start()

        async def consume():
            async for item in generator:
                out.append((time.time(), item))

        def speech_frames(start=0):
            return sum(1 for _, f in out[start:] if isinstance(f, rtc.AudioFrame)
                       and np.frombuffer(f.data, np.int16).any())

        def silent_tail():
            """Released (not held) silent frames at the end of the output."""
            n = 0
            for _, f in reversed(out):
                if isinstance(f, rtc.AudioFrame):
                    if np.frombuffer(f.data, np.int16).any():
                        break
                    n += 1
            return n

        reader = asyncio.create_task(consume())
        try:
            await until(lambda: len(out) >= 24, 120)  # the session renders (listening) frames
            first, marks["first_s"] = _frames("Hello from a LiveKit agent.")
            for frame in first:  # the agent's TTS: faster than real time
                await generator.push_audio(frame)
            await generator.push_audio(AudioSegmentEnd())
            await until(lambda: any(isinstance(f, AudioSegmentEnd) for _, f in out), 90)
            marks["first_done"] = len(out)
            second, marks["second_s"] = _frames("This is a much longer answer that the user will cut short very soon.")
            async def speak():
                for frame in second:  # bounded queues: the push runs about as far ahead as the pipeline lets it
                    await generator.push_audio(frame)

            # The user interrupts while the agent's TTS is still streaming (AvatarRunner pushes and
            # clears from separate tasks): the agent stops pushing, then the buffer is cleared.
            speaking = asyncio.create_task(speak())
            await until(lambda: speech_frames(marks["first_done"]) >= 24, 60)
            speaking.cancel()
            await asyncio.gather(speaking, return_exceptions=True)
            marks["clear"] = len(out)
            await generator.clear_buffer()
            await generator.push_audio(AudioSegmentEnd())  # the runner's queue may still hold one
            await until(lambda: silent_tail() >= 24, 30)
        finally:
            await session.stop()
            await asyncio.wait_for(reader, 10)  # iteration ends with the session

    asyncio.run(main())
    return out, marks


def test_video_and_audio_frames_alternate_in_sync(livekit_run):
    out, _ = livekit_run
    items = [f for _, f in out if not isinstance(f, AudioSegmentEnd)]
    videos, audios = items[0::2], items[1::2]
    assert len(videos) > 24 * 3
    assert all(isinstance(v, rtc.VideoFrame) and v.type == rtc.VideoBufferType.RGB24 for v in videos)
    assert all(isinstance(a, rtc.AudioFrame) and a.sample_rate == 48_000 and a.samples_per_channel == 2_000
               and a.num_channels == 1 for a in audios)  # each video frame's own 1/24 s of audio
    assert len({(v.width, v.height) for v in videos}) == 1


def test_segment_speech_comes_out_then_segment_end(livekit_run):
    out, marks = livekit_run
    first = [f for _, f in out[:marks["first_done"]]]
    assert isinstance(first[-1], AudioSegmentEnd)
    audio = [np.frombuffer(f.data, np.int16) for f in first if isinstance(f, rtc.AudioFrame)]
    spoken_s = sum(1 for a in audio if a.any()) / 24
    assert spoken_s == pytest.approx(marks["first_s"], abs=0.35)  # all of it (exact zeros in pauses aside)
    last_speech = max(i for i, a in enumerate(audio) if a.any())
    assert len(audio) - 1 - last_speech >= 8  # the end is announced after the speech has played out


def test_clear_buffer_stops_the_character(livekit_run):
    out, marks = livekit_run
    after = [np.frombuffer(f.data, np.int16) for _, f in out[marks["clear"]:] if isinstance(f, rtc.AudioFrame)]
    assert sum(1 for a in after if a.any()) <= 4 * 4  # at most what was already leaving playout
    assert not any(a.any() for a in after[-24:])  # listening again
    spoken = [np.frombuffer(f.data, np.int16) for _, f in out[marks["first_done"]:] if isinstance(f, rtc.AudioFrame)]
    assert sum(1 for a in spoken if a.any()) / 24 < marks["second_s"] - 1.0
