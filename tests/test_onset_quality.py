"""A turn's speech placed at a frame inside a chunk (turn-start rollback): the frames before the onset
come from that chunk's listening version, the rest from its speech version. With the trained ``tiny``
model, its real audio encoder and decoder: lip sync is as good as with the speech on a chunk boundary,
and the seam is no bigger than a few ordinary frame-to-frame changes."""

import numpy as np
import pytest
import torch

from charstream.model.config import get_preset
from charstream.model.generator import Generator
from charstream.model.weights import resolve_weights
from charstream.pipeline.quality.lipsync import score_av
from charstream.stages.agents.tts import synthesize
from charstream.stages.conditioning.stage import build as build_conditioning
from charstream.stages.config import ConditioningConfig, DecodeConfig
from charstream.stages.decode.stage import DecodeStage
from charstream.stages.diffusion.stage import chunk_seed, reference_latent
from charstream.stages.ingest.resample import resample, to_int16
from charstream.timeline import SAMPLES_PER_CHUNK, SAMPLES_PER_FRAME, TIMELINE_RATE

SPEECH_AT, SPEECH_CHUNKS = 4, 12  # listening chunks, then the speech's


@pytest.fixture(scope="module")
def parts():
    path = resolve_weights("tiny", "packaged")
    conditioning = build_conditioning(ConditioningConfig(), "tiny")
    decode = DecodeStage(DecodeConfig(threads=1), "tiny")
    decode.decoder = decode._load(path)
    speech = synthesize("A small video model draws each frame from my voice.", "en+f3")
    audio = to_int16(resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, TIMELINE_RATE))
    return path, conditioning, decode, reference_latent("tiny", path, 0, "cpu"), audio


def session(parts, onset: int) -> tuple[np.ndarray, np.ndarray]:
    """Frames and timeline audio of listening chunks, then the speech from frame ``onset`` of chunk
    SPEECH_AT -- made the way a live session makes it: the listening chunk first, then a rewind."""
    path, conditioning, decode, reference, speech = parts
    generator = Generator(get_preset("tiny"), path, "cpu", None, torch.float32, False)
    generator.reset_session(reference)
    placed = SPEECH_AT * SAMPLES_PER_CHUNK + onset * SAMPLES_PER_FRAME
    timeline = np.zeros((SPEECH_AT + SPEECH_CHUNKS) * SAMPLES_PER_CHUNK, np.int16)
    timeline[placed:placed + len(speech)] = speech[:len(timeline) - placed]
    context, span = conditioning.context, SAMPLES_PER_CHUNK + conditioning.lookahead
    padded = np.concatenate([np.zeros(context, np.int16), timeline, np.zeros(span, np.int16)])
    frames, states = [], {-1: None}

    def step(chunk: int, window: np.ndarray) -> None:
        latent = generator.step(torch.from_numpy(np.asarray(conditioning.encode(window), np.float32)),
                                chunk_seed(0, chunk))
        video, states[chunk] = decode._decode(latent.float().numpy(), states[chunk - 1])
        frames.append(video.copy())

    with torch.inference_mode():
        for chunk in range(SPEECH_AT + 1):  # listening; the last is chunk SPEECH_AT's listening version
            step(chunk, np.zeros(context + span, np.int16))
        listening = frames.pop()
        assert generator.rollback(1) == 0  # the turn start's rewind: exact
        for chunk in range(SPEECH_AT, SPEECH_AT + SPEECH_CHUNKS):
            step(chunk, padded[chunk * SAMPLES_PER_CHUNK:chunk * SAMPLES_PER_CHUNK + context + span])
    frames[SPEECH_AT][:onset] = listening[:onset]  # what playout shows before the onset
    return np.concatenate(frames), timeline


def test_speech_placed_inside_a_chunk_keeps_lip_sync_and_a_small_seam(parts):
    scores, seams = {}, {}
    for onset in (0, 2):
        frames, audio = session(parts, onset)
        scores[onset] = score_av(frames, audio)
        steps = np.abs(np.diff(frames.astype(np.int16), axis=0)).mean(axis=(1, 2, 3))
        speaking = steps[SPEECH_AT * 4:]
        seams[onset] = steps[SPEECH_AT * 4 + onset - 1] / np.median(speaking)
    for onset in (2,):
        assert scores[onset].confidence >= scores[0].confidence - 0.02, scores
        assert abs(scores[onset].offset_frames - scores[0].offset_frames) <= 1, scores
        assert seams[onset] < 4.0, seams  # measured 1.0-2.2 median frame changes
    assert scores[0].confidence > 0.8, scores
