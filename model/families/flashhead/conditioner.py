"""FlashHead's audio conditioning on the serving timeline: one chunk's 48 kHz window -> its audio tokens.

The conditioning stage cuts each chunk a window of the 48 kHz timeline: the ``audio_context_s`` seconds
ending at the chunk's end (the rolling context the released pipeline re-encodes every chunk; silence
before the session's speech). Here it is decimated to 16 kHz (the characters encoder's Kaiser sinc
low-pass, so the two families hear speech through one filter), run through wav2vec2 at the video frame
rate, and the adapter turns the chunk's newest ``frames_per_chunk`` frames' windows into
(latents, audio_tokens, d) tokens. ``encode_batch`` does it for several sessions' windows at once (the
conditioning stage's batcher): in power-of-two groups, as the chunk runner batches, so wav2vec2's
convolutions meet a few shapes only.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from charstream.model.audio_encoder import lowpass_taps
from charstream.model.families.flashhead.audio import AudioAdapter, SpeechFeatures, frame_windows
from charstream.model.families.flashhead.chunks import batch_groups
from charstream.model.families.flashhead.config import FlashHeadConfig
from charstream.timeline import TIMELINE_RATE


class ChunkSpeechEncoder:
    def __init__(self, cfg: FlashHeadConfig, speech: SpeechFeatures, adapter: AudioAdapter) -> None:
        if TIMELINE_RATE % cfg.sample_rate:
            raise ValueError(f"{cfg.name}: {cfg.sample_rate} Hz speech does not divide the {TIMELINE_RATE} Hz timeline")
        self.cfg, self.speech, self.adapter = cfg, speech, adapter
        self.factor = TIMELINE_RATE // cfg.sample_rate
        # float64: the decimation runs on the encoder's device, where cuDNN may take float32 convolutions in TF32
        self.taps = lowpass_taps(self.factor).view(1, 1, -1).to(adapter.first_in.weight.device, torch.float64)
        self.window_samples = cfg.audio_context_s * TIMELINE_RATE

    @property
    def context_ms(self) -> float:
        """Timeline before the chunk's new frames that the window holds: the context less the chunk."""
        return 1000 * (self.cfg.audio_context_s - self.cfg.new_frames_per_chunk / self.cfg.fps)

    def encode(self, window: np.ndarray) -> np.ndarray:
        """int16 (audio_context_s x 48 kHz,) ending at the chunk's end -> float32 (latents, tokens, d)."""
        return self.encode_batch([window])[0]

    @torch.no_grad()
    def encode_batch(self, windows: list[np.ndarray]) -> list[np.ndarray]:
        """``encode`` for each of several sessions' windows, run together."""
        for window in windows:
            if window.shape != (self.window_samples,):
                raise ValueError(f"a FlashHead audio window is {self.window_samples} samples at {TIMELINE_RATE} Hz, "
                                 f"got {window.shape}")
        cfg = self.cfg
        frames = cfg.audio_context_s * cfg.fps
        half = (self.taps.shape[-1] - 1) // 2
        out: list[np.ndarray] = []
        device = self.taps.device
        for rows in batch_groups(list(range(len(windows)))):
            x = torch.from_numpy(np.stack([windows[i] for i in rows])).to(device, torch.float64) / 32768.0
            samples = F.conv1d(F.pad(x[:, None], (half, half)), self.taps, stride=self.factor)[:, 0]
            features = self.speech(samples, frames)  # (rows, frames, layers, 768)
            batch = frame_windows(features, frames - cfg.frames_per_chunk, frames, cfg.audio_window)
            out.extend(self.adapter(batch.to(device)).float().cpu().numpy())
        return out
