"""charstream as the avatar of a Pipecat bot (needs the extra: pip install -e '.[pipecat]').

In a real bot, put the service between the TTS and the transport's output, in place of a hosted
avatar service:

    config = PipelineConfig(); config.ingest.adapter = "pipecat"
    avatar = CharstreamVideoService(EmbeddedSession(config, session_id))
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, avatar, transport.output(), assistant_agg])

This example runs offline: a small espeak-ng "TTS" processor turns text into TTS frames, the
character speaks them, and the frames that come out (images + their audio) are written to an mp4:

    python examples/pipecat_avatar.py --line "Hello from Pipecat!" --out pipecat-avatar.mp4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from fractions import Fraction

import av
import numpy as np
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    OutputAudioRawFrame,
    OutputImageRawFrame,
    TextFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.integrations.embedded import EmbeddedSession
from charstream.pipeline.integrations.pipecat import CharstreamVideoService
from charstream.stages.agents.tts import synthesize
from charstream.timeline import TIMELINE_RATE, VIDEO_FPS


class EspeakTTS(FrameProcessor):
    """TextFrame -> TTSStartedFrame, 20 ms TTSAudioRawFrames (22,050 Hz), TTSStoppedFrame."""

    def __init__(self, voice: str) -> None:
        super().__init__()
        self.voice = voice

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, TextFrame):
            await self.push_frame(frame, direction)
            return
        speech = await asyncio.to_thread(synthesize, frame.text, self.voice)
        step = speech.sample_rate // 50
        await self.push_frame(TTSStartedFrame())
        for i in range(0, len(speech.samples), step):
            await self.push_frame(TTSAudioRawFrame(audio=speech.samples[i:i + step].tobytes(),
                                                   sample_rate=speech.sample_rate, num_channels=1))
        await self.push_frame(TTSStoppedFrame())


class Mp4Writer(FrameProcessor):
    """Writes the character's frames and their audio to an mp4 (what a WebRTC transport would send)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.container = av.open(path, mode="w")
        self.video = None
        self.audio = self.container.add_stream("aac", rate=TIMELINE_RATE, layout="mono")
        self.frames = 0
        self.spoken = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputImageRawFrame):
            width, height = frame.size
            if self.video is None:
                self.video = self.container.add_stream("libx264", rate=VIDEO_FPS)
                self.video.width, self.video.height, self.video.pix_fmt = width, height, "yuv420p"
            image = np.frombuffer(frame.image, np.uint8).reshape(height, width, 3)
            video_frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            video_frame.pts, video_frame.time_base = self.frames, Fraction(1, VIDEO_FPS)
            self.container.mux(self.video.encode(video_frame))
            self.frames += 1
        elif isinstance(frame, OutputAudioRawFrame):
            samples = np.frombuffer(frame.audio, np.int16)
            self.spoken += bool(samples.any())
            audio_frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
            audio_frame.sample_rate = frame.sample_rate
            self.container.mux(self.audio.encode(audio_frame))
        elif isinstance(frame, EndFrame):
            if self.video is not None:
                self.container.mux(self.video.encode())
            self.container.mux(self.audio.encode())
            self.container.close()
        await self.push_frame(frame, direction)


async def run(lines: list[str], out: str, voice: str, seconds_after: float) -> None:
    config = PipelineConfig()
    config.ingest.adapter = "pipecat"
    writer = Mp4Writer(out)
    worker = PipelineWorker(Pipeline([EspeakTTS(voice), CharstreamVideoService(EmbeddedSession(config, "pipecat-demo")),
                                      writer]), params=PipelineParams(), enable_rtvi=False, idle_timeout_secs=None)
    runner = WorkerRunner(handle_sigint=True)
    await runner.add_workers(worker)

    async def speak() -> None:
        while writer.frames < VIDEO_FPS:  # the session is up and rendering
            await asyncio.sleep(0.1)
        expected = 0
        for line in lines:
            await worker.queue_frame(TextFrame(line))
            expected += int(synthesize(line, voice).duration * VIDEO_FPS) - 2
            for _ in range(300):  # until the line has been spoken (a slow CPU underruns), 30 s at most
                if writer.spoken >= expected:
                    break
                await asyncio.sleep(0.1)
        await asyncio.sleep(seconds_after)
        await worker.queue_frame(EndFrame())

    await asyncio.gather(runner.run(), speak())
    print(f"wrote {out}: {writer.frames} frames ({writer.frames / VIDEO_FPS:.1f} s), "
          f"{writer.spoken / VIDEO_FPS:.1f} s of speech")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line", action="append", help="a line for the character to say (repeatable)")
    parser.add_argument("--out", default="pipecat-avatar.mp4")
    parser.add_argument("--voice", default="en+f3")
    parser.add_argument("--seconds-after", type=float, default=1.0)
    args = parser.parse_args(argv)
    lines = args.line or ["Hello! I am a charstream character, speaking through a Pipecat pipeline."]
    asyncio.run(run(lines, args.out, args.voice, args.seconds_after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
