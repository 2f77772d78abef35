"""FlashHead's audio conditioning on the serving timeline: one chunk's 48 kHz window -> its audio tokens.

The conditioning stage cuts each chunk a window of the 48 kHz timeline: the ``audio_context_s`` seconds
ending at the chunk's end (the rolling context the released pipeline re-encodes every chunk; silence
before the session's speech). Here it is decimated to 16 kHz (the characters encoder's Kaiser sinc
low-pass, so the two families hear speech through one filter), run through wav2vec2 at the video frame
rate, and the adapter turns the chunk's newest ``frames_per_chunk`` frames' windows into
(latents, audio_tokens, d) tokens. ``encode_batch`` does it for several sessions' windows at once (the
conditioning stage's batcher): in power-of-two groups, as the chunk runner batches, so wav2vec2's
convolutions meet a few shapes only.

On a GPU a lone window (a session's own encode) replays a CUDA graph of the whole encode (``graphed``):
eager, its ~400 small kernels are launched from Python, each taking the GIL that the process's chunk,
playout and WebRTC threads also hold, and a turn's first encode is on the path to its first speaking
frame. The graph is the process's one (the family shares the encoder), so its replays take turns.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from charstream.model.audio_encoder import lowpass_taps
from charstream.model.families.flashhead.audio import AudioAdapter, SpeechFeatures, frame_windows
from charstream.model.families.flashhead.chunks import batch_groups
from charstream.model.families.flashhead.config import FlashHeadConfig
from charstream.model.graphs import capture_graph, one_capture_at_a_time
from charstream.timeline import TIMELINE_RATE


class ChunkSpeechEncoder:
    def __init__(self, cfg: FlashHeadConfig, speech: SpeechFeatures, adapter: AudioAdapter, graphed: bool = False) -> None:
        """``graphed``: on a CUDA device, a lone window's encode replays a CUDA graph captured now."""
        if TIMELINE_RATE % cfg.sample_rate:
            raise ValueError(f"{cfg.name}: {cfg.sample_rate} Hz speech does not divide the {TIMELINE_RATE} Hz timeline")
        self.cfg, self.speech, self.adapter = cfg, speech, adapter
        self.factor = TIMELINE_RATE // cfg.sample_rate
        # float64: the decimation runs on the encoder's device, where cuDNN may take float32 convolutions in TF32
        self.taps = lowpass_taps(self.factor).view(1, 1, -1).to(adapter.first_in.weight.device, torch.float64)
        self.window_samples = cfg.audio_context_s * TIMELINE_RATE
        self.graph: torch.cuda.CUDAGraph | None = None
        self._turn = threading.Lock()  # one static window and tokens: replays take turns
        if graphed and self.taps.is_cuda:
            self._capture()

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
        out: list[np.ndarray] = []
        for rows in batch_groups(list(range(len(windows)))):
            if self.graph is not None and len(rows) == 1:
                out.append(self._replay(windows[rows[0]]))
                continue
            samples = torch.from_numpy(np.stack([windows[i] for i in rows])).to(self.taps.device)
            out.extend(self.tokens(samples).cpu().numpy())
        return out

    def tokens(self, samples: Tensor) -> Tensor:
        """int16 windows (rows, window_samples) on the encoder's device -> float32 (rows, latents, tokens, d)."""
        cfg = self.cfg
        frames = cfg.audio_context_s * cfg.fps
        half = (self.taps.shape[-1] - 1) // 2
        x = samples.to(torch.float64) / 32768.0
        speech = F.conv1d(F.pad(x[:, None], (half, half)), self.taps, stride=self.factor)[:, 0]
        features = self.speech(speech, frames)  # (rows, frames, layers, 768)
        return self.adapter(frame_windows(features, frames - cfg.frames_per_chunk, frames, cfg.audio_window)).float()

    @one_capture_at_a_time
    @torch.no_grad()
    def _capture(self) -> None:
        self.samples = torch.zeros(1, self.window_samples, dtype=torch.int16, device=self.taps.device)
        self.capture_stream = torch.cuda.Stream(self.taps.device)  # kept (model/graphs.py says why)
        self.graph, self.graph_tokens = capture_graph(lambda: self.tokens(self.samples), self.capture_stream)

    def _replay(self, window: np.ndarray) -> np.ndarray:
        with self._turn:
            self.samples.copy_(torch.from_numpy(window)[None])
            self.graph.replay()
            return self.graph_tokens[0].cpu().numpy()  # a copy: the next replay rewrites the static tokens
