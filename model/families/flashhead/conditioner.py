"""FlashHead's audio conditioning on the serving timeline: one chunk's 48 kHz window -> its audio tokens.

The conditioning stage cuts each chunk a window of the 48 kHz timeline: the ``audio_context_s`` seconds
ending at the chunk's end (the rolling context the released pipeline re-encodes every chunk; silence
before the session's speech). Here it is decimated to 16 kHz (the characters encoder's Kaiser sinc
low-pass, so the two families hear speech through one filter), run through wav2vec2 at the video frame
rate, and the adapter turns the chunk's newest ``frames_per_chunk`` frames' windows into
(latents, audio_tokens, d) tokens.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from charstream.model.audio_encoder import lowpass_taps
from charstream.model.families.flashhead.audio import AudioAdapter, SpeechFeatures, frame_windows
from charstream.model.families.flashhead.config import FlashHeadConfig
from charstream.timeline import TIMELINE_RATE


class ChunkSpeechEncoder:
    def __init__(self, cfg: FlashHeadConfig, speech: SpeechFeatures, adapter: AudioAdapter) -> None:
        if TIMELINE_RATE % cfg.sample_rate:
            raise ValueError(f"{cfg.name}: {cfg.sample_rate} Hz speech does not divide the {TIMELINE_RATE} Hz timeline")
        self.cfg, self.speech, self.adapter = cfg, speech, adapter
        self.factor = TIMELINE_RATE // cfg.sample_rate
        self.taps = lowpass_taps(self.factor).view(1, 1, -1)
        self.window_samples = cfg.audio_context_s * TIMELINE_RATE

    @property
    def context_ms(self) -> float:
        """Timeline before the chunk's new frames that the window holds: the context less the chunk."""
        return 1000 * (self.cfg.audio_context_s - self.cfg.new_frames_per_chunk / self.cfg.fps)

    @torch.no_grad()
    def encode(self, window: np.ndarray) -> np.ndarray:
        """int16 (audio_context_s x 48 kHz,) ending at the chunk's end -> float32 (latents, tokens, d)."""
        if window.shape != (self.window_samples,):
            raise ValueError(f"a FlashHead audio window is {self.window_samples} samples at {TIMELINE_RATE} Hz, "
                             f"got {window.shape}")
        x = torch.from_numpy(window.astype(np.float32) / 32768.0)
        half = (self.taps.shape[-1] - 1) // 2
        samples = F.conv1d(F.pad(x[None, None], (half, half)), self.taps, stride=self.factor)[0, 0]
        cfg = self.cfg
        frames = cfg.audio_context_s * cfg.fps
        features = self.speech(samples, frames)
        windows = frame_windows(features, frames - cfg.frames_per_chunk, frames, cfg.audio_window)[None]
        return self.adapter(windows.to(self.adapter.first_in.weight.device))[0].float().cpu().numpy()
