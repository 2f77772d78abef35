"""The user's microphone from egress (a real UserAudioQueue, 20 ms frames at 48 kHz) reaches the
ingest stage's VAD: the user's turn is detected and its end back-dated."""

import time

import anyio
import numpy as np
from ingest_support import Recorder

from charstream.stages.agents.tts import synthesize
from charstream.stages.config import IngestConfig
from charstream.stages.egress.mic import UserAudioFrame, UserAudioQueue
from charstream.stages.ingest.push import PushAdapter
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.stage import IngestStage
from charstream.transport.messages import TurnKind


def test_microphone_queue_drives_turn_detection():
    speech = synthesize("Can you hear me through the microphone?", "en-us")
    mic = to_int16(resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, 48_000))
    signal = np.concatenate([np.zeros(24_000, np.int16), mic, np.zeros(48_000, np.int16)])
    last_voiced = np.flatnonzero(np.abs(signal.astype(np.int32)) > 328)[-1]
    queue = UserAudioQueue(max_frames=len(signal) // 960 + 1)
    config = IngestConfig()
    adapter = PushAdapter()
    stage = IngestStage(config, adapter, user_audio=queue)
    rec = Recorder()
    t0 = time.time()
    for i in range(0, len(signal) - 959, 960):  # as egress stamps them: arrival = end of the frame
        queue.put(UserAudioFrame(signal[i:i + 960], t0 + (i + 960) / 48_000))
    queue.close()

    async def main():
        ctx = rec.context()
        await stage.setup(ctx)
        await adapter.end()  # no agent: run returns once the microphone closes
        with anyio.fail_after(20):
            await stage.run(ctx)

    anyio.run(main)
    events = rec.turn_events()
    assert [e.kind for e in events] == [TurnKind.USER_SPEECH_START, TurnKind.USER_SPEECH_END]
    assert abs(events[1].at - (t0 + last_voiced / 48_000)) <= 0.100
    assert events[1].trace.stamps["user_speech_end"] == events[1].at


def test_microphone_is_heard_when_ingest_starts_before_the_first_packet():
    """The mic is an explicit input: an empty queue at start (falsy by ``len``) is still read."""
    speech = synthesize("Hello, are you listening?", "en-us")
    mic = to_int16(resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, 48_000))
    signal = np.concatenate([np.zeros(9_600, np.int16), mic, np.zeros(48_000, np.int16)])
    queue = UserAudioQueue(max_frames=len(signal) // 960 + 1)
    adapter = PushAdapter()
    stage = IngestStage(IngestConfig(), adapter, user_audio=queue)
    rec = Recorder()

    async def main():
        ctx = rec.context()
        await stage.setup(ctx)
        assert len(queue) == 0  # nothing arrived yet: the case that used to leave a session deaf
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run, ctx)
            await anyio.sleep(0.2)  # ingest is running before the first packet
            t0 = time.time()
            for i in range(0, len(signal) - 959, 960):
                queue.put(UserAudioFrame(signal[i:i + 960], t0 + (i + 960) / 48_000))
                await anyio.sleep(0)
            queue.close()
            await adapter.end()
            with anyio.fail_after(20):
                while not any(e.kind == TurnKind.USER_SPEECH_END for e in rec.turn_events()):
                    await anyio.sleep(0.05)

    anyio.run(main)
    assert [e.kind for e in rec.turn_events()] == [TurnKind.USER_SPEECH_START, TurnKind.USER_SPEECH_END]
