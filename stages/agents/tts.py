"""Real speech synthesis with espeak-ng, from the ``espeakng-loader`` wheel (library + voices).

libespeak-ng keeps global state and is not re-entrant, so every call holds one process-wide lock.
Besides the waveform, synthesis returns espeak's phoneme events: their timing is exact, which
the training data uses to shape the character's mouth.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_PHONEME_EVENTS = 0x0001
_INITIALIZE_DONT_EXIT = 0x8000
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH = 1, 2, 3
_EVENT_WORD, _EVENT_END, _EVENT_MSG_TERMINATED, _EVENT_PHONEME = 1, 5, 6, 7


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass
class Speech:
    samples: np.ndarray  # int16 mono
    sample_rate: int
    phonemes: list[tuple[float, str]]  # (start seconds, espeak phoneme mnemonic)
    words: list[tuple[float, int, int]]  # (start seconds, text position, length)

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate


class _Engine:
    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.restype = ctypes.c_int
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]
        data_parent = str(Path(espeakng_loader.get_data_path()).parent).encode()
        rate = self.lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, data_parent, _INITIALIZE_PHONEME_EVENTS | _INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise RuntimeError(f"espeak-ng failed to initialise (returned {rate}) with data at {data_parent!r}")
        # breathy voices (en+f3) draw noise from espeak's generator, which it seeds from the clock's second:
        # a fixed seed makes a process's utterances the same audio in every run
        self.lib.espeak_ng_SetRandSeed(0)
        self.sample_rate = rate
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, int, int, int, bytes]] = []
        self._callback = _Callback(self._on_audio)  # keep a reference: espeak holds the pointer
        self.lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav, n: int, events) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        i = 0
        while events[i].type != 0:  # espeakEVENT_LIST_TERMINATED
            e = events[i]
            name = e.id.string if e.type == _EVENT_PHONEME else b""
            self._events.append((e.type, e.audio_position, e.text_position, e.length, name))
            i += 1
        return 0

    def synthesize(self, text: str, voice: str, rate_wpm: int, pitch: int) -> Speech:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(_PARAM_RATE, int(rate_wpm), 0)
        self.lib.espeak_SetParameter(_PARAM_PITCH, int(pitch), 0)
        self._chunks, self._events = [], []
        data = text.encode("utf-8") + b"\0"
        buf = ctypes.create_string_buffer(data)
        status = self.lib.espeak_Synth(buf, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if status != 0:
            raise RuntimeError(f"espeak_Synth failed with status {status}")
        samples = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        phonemes = [(pos / 1000.0, name.decode("ascii", "replace")) for t, pos, _, _, name in self._events
                    if t == _EVENT_PHONEME]
        words = [(pos / 1000.0, tpos, length) for t, pos, tpos, length, _ in self._events if t == _EVENT_WORD]
        return Speech(samples.astype(np.int16), self.sample_rate, phonemes, words)


_lock = threading.Lock()
_engine: _Engine | None = None


def synthesize(text: str, voice: str = "en-us", rate_wpm: int = 170, pitch: int = 50) -> Speech:
    """Speak ``text`` with an espeak-ng voice (e.g. ``en-us``, ``en-gb+f3``); 22,050 Hz int16."""
    global _engine
    with _lock:
        if _engine is None:
            _engine = _Engine()
        return _engine.synthesize(text, voice, rate_wpm, pitch)
