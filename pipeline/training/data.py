"""Training and held-out clips: rendered character paired with real espeak-ng speech.

A clip is fully determined by ``(split, seed)``: random sentences from ``WORDS`` spoken by a
random voice/rate/pitch, with pauses between sentences (the character idles there), resampled
from 22,050 Hz onto the 48 kHz timeline, and the character rendered at 24 fps with its mouth
opening with the speech level of each frame and rounding on rounded vowels (espeak's phoneme
timing). Train and held-out clips draw from disjoint seed streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from charstream.model.character import Motion, idle_motion, make_identity, render
from charstream.pipeline.quality.lipsync import speech_envelope
from charstream.stages.agents.tts import synthesize
from charstream.stages.ingest.resample import resample, to_int16
from charstream.timeline import SAMPLES_PER_FRAME, TIMELINE_RATE, VIDEO_FPS

VOICES = (
    "en-us", "en", "en+f3", "en-us+f3", "en-gb-x-rp", "en+m3", "en-us+f1", "en+f4",
    "en-gb-x-rp+f2", "en-us+m5", "en+m7", "en-gb-x-rp+m1",
)
N_IDENTITIES = 8  # characters in the training set; the demo shows identity 0
SPLIT_STREAMS = {"train": 0x7A1, "heldout": 0x4E1D}
ROUNDED = {"u:", "U", "oU", "O:", "w", "aU", "OI", "0", "u", "O", "o", "W", "3:"}

WORDS = """
the a an this that these some every any no one two three four five six seven eight nine ten
I you we they she he it people friend family teacher doctor student child mother father
morning evening night today tomorrow yesterday week year moment minute hour time day
go come make take give find think know see look want need like love help try keep start
tell ask work play read write speak listen learn call move live believe bring happen stand
open close follow change lead understand watch begin remember build stay fall reach kill
good new first last long great little own other old right big high different small large
next early young important few public bad same able happy sorry ready simple quiet bright
house home room door window table chair book paper letter story picture music song voice
water coffee tea bread apple garden flower tree river mountain ocean city street road car
train plane boat bicycle school office market shop bank hospital library kitchen station
really very quite always never often sometimes maybe perhaps almost already still again
and but or because so if when while after before until since although unless
about above across after against along among around at behind below beside between
beyond during for from in inside into near of off on onto out over past through to toward
under up with within without please thank hello goodbye yes okay sure wonderful amazing
question answer problem idea reason plan weather rain snow sun wind cloud summer winter
red blue green yellow purple orange black white gray brown golden silver warm cold soft
computer phone message picture camera video movie game sport football tennis dinner lunch
breakfast sugar salt butter cheese chicken fish rice soup cake chocolate fruit orange
travel journey holiday weekend party meeting lesson project number money price market
"""


@dataclass
class ClipScript:
    """Everything of a clip but its pixels: cheap to make on CPU workers, rendered where it trains."""

    audio: np.ndarray  # int16 (T * 2000,), 48 kHz timeline
    identity: int
    motion: Motion
    text: str
    voice: str

    @property
    def n_frames(self) -> int:
        return len(self.motion)


@dataclass
class Clip(ClipScript):
    frames: torch.Tensor  # uint8 (T, 3, 128, 128)


def sentence(rng: np.random.Generator) -> str:
    words = WORDS.split()
    n = int(rng.integers(4, 13))
    text = " ".join(words[i] for i in rng.integers(0, len(words), n))
    return text[0].upper() + text[1:] + str(rng.choice([".", ".", "?", "!"]))


def speech_track(rng: np.random.Generator, n_frames: int) -> tuple[np.ndarray, list[tuple[float, str]], str, str]:
    """48 kHz speech with pauses filling ``n_frames`` frames, phonemes (s, name), text and voice."""
    voice = str(rng.choice(VOICES))
    rate, pitch = int(rng.integers(130, 211)), int(rng.integers(25, 76))
    total = n_frames * SAMPLES_PER_FRAME
    audio = np.zeros(total, np.int16)
    phonemes: list[tuple[float, str]] = []
    texts = []
    pos = int(rng.uniform(0.0, 1.0) * TIMELINE_RATE)
    while pos < total:
        text = sentence(rng)
        speech = synthesize(text, voice, rate, pitch)
        wav = to_int16(resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, TIMELINE_RATE))
        n = min(len(wav), total - pos)
        audio[pos: pos + n] = wav[:n]
        phonemes += [(pos / TIMELINE_RATE + t, p) for t, p in speech.phonemes if pos / TIMELINE_RATE + t < total]
        texts.append(text)
        pos += len(wav) + int(rng.uniform(0.15, 1.2) * TIMELINE_RATE)
    return audio, phonemes, " ".join(texts), voice


def speaking_motion(audio: np.ndarray, phonemes: list[tuple[float, str]], n_frames: int, seed: int) -> Motion:
    """Idle motion with the mouth driven by speech: openness = frame level, rounding from phonemes."""
    motion = idle_motion(n_frames, seed)
    motion.mouth_open = speech_envelope(audio)[:n_frames]
    rounded = np.zeros(n_frames)
    ends = [t for t, _ in phonemes[1:]] + [phonemes[-1][0] + 0.1] if phonemes else []
    for (start, name), end in zip(phonemes, ends, strict=True):
        if name.lstrip("'`,") in ROUNDED:
            a = int(start * VIDEO_FPS)
            b = max(int(end * VIDEO_FPS), a + 1)
            rounded[a:min(b, n_frames)] = 1.0
    # rounding eases in and out over about three frames
    motion.mouth_round = np.convolve(rounded, np.ones(3) / 3, mode="same")
    return motion


def make_script(seed: int, n_frames: int, split: str = "train", identity: int | None = None) -> ClipScript:
    """Speech and motion of one clip of ``n_frames`` frames (a multiple of 4 keeps chunks whole)."""
    if split not in SPLIT_STREAMS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLIT_STREAMS)}")
    rng = np.random.default_rng([SPLIT_STREAMS[split], seed])
    ident = int(rng.integers(N_IDENTITIES)) if identity is None else identity
    audio, phonemes, text, voice = speech_track(rng, n_frames)
    motion = speaking_motion(audio, phonemes, n_frames, int(rng.integers(2**31)))
    return ClipScript(audio, ident, motion, text, voice)


def make_clip(seed: int, n_frames: int, split: str = "train", device: str | torch.device = "cpu",
              identity: int | None = None) -> Clip:
    script = make_script(seed, n_frames, split, identity)
    frames = render(make_identity(script.identity), script.motion, device)
    return Clip(script.audio, script.identity, script.motion, script.text, script.voice, frames)


def babble_motion(n_frames: int, seed: int) -> Motion:
    """Idle motion with a random, speech-like mouth (no audio): the VAE's training video.

    The mouth follows syllable-rate noise (about 4 Hz) gated by random pauses, so every opening
    and rounding the speech-driven clips reach shows up without synthesising speech.
    """
    rng = np.random.default_rng([seed, 0xBA])
    motion = idle_motion(n_frames, seed)
    phase = np.cumsum(rng.uniform(0.1, 0.25, n_frames) * 2 * np.pi)
    level = rng.uniform(0.3, 1.0) * (0.5 + 0.5 * np.sin(phase)) ** rng.uniform(0.5, 2.0)
    talking = np.repeat(rng.random(n_frames // 12 + 1) < 0.75, 12)[:n_frames]
    motion.mouth_open = np.clip(level * talking + rng.normal(0, 0.05, n_frames), 0, 1)
    motion.mouth_round = np.convolve((rng.random(n_frames) < 0.2).astype(float), np.ones(3) / 3, mode="same")
    return motion
