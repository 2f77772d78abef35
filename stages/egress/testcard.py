"""A procedural test card: colour bars, a moving bar and the frame counter in digits, with a tone.

Used wherever real media is needed without a model (tests, benchmarks, ``charstream serve
--source testcard``). A *flash* chunk starts with a white frame and a click at the same media
instant, so a receiver can measure its audio/video offset.
"""

from __future__ import annotations

import numpy as np
from charstream.transport.messages import TraceContext, VideoChunk

from charstream.timeline import FRAMES_PER_CHUNK, SAMPLES_PER_CHUNK, TIMELINE_RATE

_BARS = np.array([[192, 192, 192], [192, 192, 0], [0, 192, 192], [0, 192, 0],
                  [192, 0, 192], [192, 0, 0], [0, 0, 192]], np.uint8)
# 3×5 bitmaps of the digits 0-9, one row string per line.
_FONT = ["111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
         "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111"]
_DIGITS = np.array([[int(b) for b in d] for d in _FONT], bool).reshape(10, 5, 3)
TONE_HZ = 440.0
TONE_AMPLITUDE = 1500
CLICK_SAMPLES = 96  # 2 ms
CLICK_AMPLITUDE = 30000


def frame_image(number: int, height: int, width: int, flash: bool = False, speaking: bool = False) -> np.ndarray:
    """One RGB frame: colour bars, a bar moving one step per frame, ``number`` in digits; a red
    border while speaking."""
    if flash:
        return np.full((height, width, 3), 255, np.uint8)
    columns = np.arange(width) * len(_BARS) // width
    image = np.repeat(_BARS[columns][None], height, axis=0)
    if speaking:
        border = max(height // 16, 2)
        image[:border] = image[-border:] = image[:, :border] = image[:, -border:] = (230, 30, 30)
    bar = (number * 4) % width
    image[:, bar:bar + max(width // 32, 2)] = 255
    scale = max(height // 32, 1)
    text = str(number % 10_000)
    top, left = height // 2, 2 * scale
    for i, ch in enumerate(text):
        glyph = np.kron(_DIGITS[int(ch)], np.ones((scale, scale), bool))
        x = left + i * 4 * scale
        region = image[top:top + glyph.shape[0], x:x + glyph.shape[1]]
        if region.shape[:2] != glyph.shape:
            break
        region[:] = 16
        region[glyph[: region.shape[0], : region.shape[1]]] = 240
    return image


def chunk_audio(chunk: int, flash: bool = False, speaking: bool = False) -> np.ndarray:
    """The chunk's 8,000 samples of a quiet continuous tone (a fifth up while speaking); a flash
    chunk starts with a click."""
    t = (chunk * SAMPLES_PER_CHUNK + np.arange(SAMPLES_PER_CHUNK)) / TIMELINE_RATE
    tone = TONE_HZ * 1.5 if speaking else TONE_HZ
    audio = (TONE_AMPLITUDE * np.sin(2 * np.pi * tone * t)).astype(np.int16)
    if flash:
        audio[:CLICK_SAMPLES] = CLICK_AMPLITUDE
    return audio


def card_chunk(session_id: str, chunk: int, height: int = 128, width: int = 128, flash: bool = False,
               speaking: bool = False, epoch: int = 0, turn_id: int | None = None) -> VideoChunk:
    frames = np.stack([frame_image(chunk * FRAMES_PER_CHUNK + i, height, width, flash and i == 0, speaking)
                       for i in range(FRAMES_PER_CHUNK)])
    return VideoChunk(session_id, chunk, frames, chunk_audio(chunk, flash, speaking), speaking, epoch,
                      TraceContext(turn_id=turn_id))

