"""The Pipecat avatar service in a real Pipecat pipeline (PipelineWorker + WorkerRunner) in front of
a real charstream session: TTS audio in; the character's frames out, each with its own audio; an
InterruptionFrame stops the character's speech."""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("pipecat", reason="extra 'pipecat' not installed (make test installs it)")

from charstream.pipeline.config import PipelineConfig  # noqa: E402
from charstream.pipeline.integrations.avatar_session import AvatarSession  # noqa: E402
from charstream.pipeline.integrations.pipecat import CharstreamVideoService  # noqa: E402
from charstream.stages.ingest.resample import resample  # noqa: E402
from charstream.stages.ingest.tts import synthesize  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    InterruptionFrame,
    OutputAudioRawFrame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402
from waiting import until  # noqa: E402

FIRST = "Hello, I am speaking through Pipecat."
SECOND = "This second sentence is long, and it will be interrupted before it can finish at all."


class Collector(FrameProcessor):
    """The pipeline's last processor: keeps the character's frames as they arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[float, OutputImageRawFrame]] = []
        self.audio: list[np.ndarray] = []
        self.chunks: list[int | None] = []  # the frame's chunk; None: held through an underrun

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputImageRawFrame):
            self.images.append((time.time(), frame))
        elif isinstance(frame, OutputAudioRawFrame):
            assert frame.sample_rate == 48_000 and frame.num_channels == 1
            self.audio.append(np.frombuffer(frame.audio, np.int16))
            self.chunks.append(frame.metadata["charstream"]["chunk"])
        await self.push_frame(frame, direction)


def _tts_frames(text: str) -> tuple[list[TTSAudioRawFrame], np.ndarray]:
    speech = synthesize(text, "en+f3")
    step = speech.sample_rate // 50  # 20 ms, as a Pipecat TTS service pushes them
    frames = [TTSAudioRawFrame(audio=speech.samples[i:i + step].tobytes(), sample_rate=speech.sample_rate,
                               num_channels=1) for i in range(0, len(speech.samples), step)]
    return frames, speech.samples


@pytest.fixture(scope="module")
def pipecat_run():
    config = PipelineConfig()
    config.ingest.adapter = "pipecat"
    sink = Collector()
    first, first_pcm = _tts_frames(FIRST)
    second, _ = _tts_frames(SECOND)
    marks = {}

    def spoken(start: int = 0) -> int:
        """Frames of speech released from ``start`` on (hold frames of an underrun excluded)."""
        return sum(1 for a, c in zip(sink.audio[start:], sink.chunks[start:], strict=True) if c is not None and a.any())

    def listening_tail() -> int:
        """Released (not held) silent frames since the last frame of speech."""
        n = 0
        for a, c in zip(reversed(sink.audio), reversed(sink.chunks), strict=True):
            if a.any():
                break
            n += c is not None
        return n

    async def settle(start: int) -> None:
        """Wait until the speech from ``start`` on stops growing (CPU speed varies: no fixed sleeps)."""
        count, since = -1, time.monotonic()
        while time.monotonic() - since < 1.5:
            if spoken(start) != count:
                count, since = spoken(start), time.monotonic()
            await asyncio.sleep(0.05)

    async def conversation(worker):
        assert await until(lambda: len(sink.images) >= 24, 120), "the session rendered no frames"
        await worker.queue_frames([TTSStartedFrame(), *first, TTSStoppedFrame()])  # faster than real time
        await until(lambda: spoken() >= len(first_pcm) / 22_050 * 24 - 2, 90)  # all of it, however slow the CPU
        await settle(0)
        marks["first_done"], marks["first_spoken"] = len(sink.audio), spoken() / 24
        await worker.queue_frames([TTSStartedFrame(), *second, TTSStoppedFrame()])
        await until(lambda: spoken(marks["first_done"]) >= 24, 60)  # one second into the reply
        marks["interrupt"] = len(sink.audio)
        await worker.queue_frame(InterruptionFrame())
        await settle(marks["interrupt"])
        await until(lambda: listening_tail() >= 24, 60)
        await worker.queue_frame(EndFrame())

    async def main():  # Pipecat's runner belongs to a running loop: build everything inside it
        service = CharstreamVideoService(AvatarSession(config, "pipecat-test"))
        worker = PipelineWorker(Pipeline([service, sink]), params=PipelineParams(), enable_rtvi=False,
                                idle_timeout_secs=None)
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        await asyncio.wait_for(asyncio.gather(runner.run(), conversation(worker)), 200)

    asyncio.run(main())
    return sink, first_pcm, marks, synthesize(SECOND, "en+f3").duration


def test_frames_come_out_with_their_own_audio(pipecat_run):
    sink, _, _, _ = pipecat_run
    assert len(sink.images) == len(sink.audio) > 24 * 5
    sizes = {frame.size for _, frame in sink.images}
    assert len(sizes) == 1
    (width, height), = sizes
    assert all(len(frame.image) == width * height * 3 for _, frame in sink.images)
    assert all(len(a) == 2_000 for a in sink.audio)  # one 24 fps frame of 48 kHz audio each
    # playout's clock: frames leave at 24 fps
    times = [t for t, _ in sink.images]
    assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(24, rel=0.15)


def test_the_tts_speech_comes_out_in_full_and_intact(pipecat_run):
    sink, first_pcm, marks, _ = pipecat_run
    # the released speech, with the hold frames of any underrun (CPU too slow) left out
    played = [a for a, c in zip(sink.audio[:marks["first_done"]], sink.chunks, strict=False) if c is not None]
    out = np.concatenate(played).astype(np.float32)
    voiced = np.flatnonzero(np.abs(out) > 0)
    spoken = out[voiced[0]:voiced[-1] + 1]
    reference = resample(first_pcm.astype(np.float32), 22_050, 48_000)
    ref_voiced = np.flatnonzero(np.abs(reference) > 0.5)
    reference = reference[ref_voiced[0]:ref_voiced[-1] + 1]
    assert abs(len(spoken) - len(reference)) <= 2_000  # all of it, once (within a frame)
    n = min(len(spoken), len(reference))
    corr = np.corrcoef(spoken[:n], reference[:n])[0, 1]
    assert corr > 0.95, corr  # the same samples, not merely some sound


def test_interruption_frame_stops_the_character(pipecat_run):
    sink, _, marks, second_duration = pipecat_run
    after = [a for a, c in zip(sink.audio[marks["interrupt"]:], sink.chunks[marks["interrupt"]:], strict=True)
             if c is not None]
    spoken_after = sum(1 for a in after if a.any())
    # what was already on its way out (playout depth + one chunk) may still play; the rest is dropped
    assert spoken_after <= 4 * 4, spoken_after
    assert not any(a.any() for a in after[-24:])  # back to listening
    spoken_second = sum(1 for a, c in zip(sink.audio, sink.chunks, strict=True)
                        if c is not None and a.any()) / 24 - marks["first_spoken"]
    assert spoken_second < second_duration - 1.0
