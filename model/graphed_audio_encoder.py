"""The audio encoder (model/audio_encoder.py) on a GPU: one chunk's window -> tokens as one CUDA graph.

An eager ``encode_window`` launches ~540 small kernels from Python (the resampler, the STFT and mel
filters, the conv + transformer network): milliseconds of the host's time per chunk, and in an engine
that hosts many sessions every launch takes the one GIL that the other sessions' steps, decodes and
channels wait on. ``GraphedAudioEncoder(encoder).encode(window)`` copies the int16 window into a
static buffer, replays the graph and copies the tokens out: ``make_encode_fn``'s contract, the same
tokens to float rounding (``tests/test_conditioning_gpu.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from charstream.model.audio_encoder import AudioEncoder
from charstream.model.graphs import capture_graph, one_capture_at_a_time


class GraphedAudioEncoder:
    def __init__(self, encoder: AudioEncoder) -> None:
        self.encoder = encoder.eval()
        self.window_samples = encoder.window_samples
        self.samples = torch.zeros(1, encoder.window_samples, dtype=torch.int16, device=encoder.taps.device)
        self._capture()

    def _body(self) -> torch.Tensor:
        window = self.samples.float() / 32768.0  # as encode_window reads int16 (exact: a power of two)
        return self.encoder(self.encoder.window_features(window))[0].float()

    @one_capture_at_a_time
    @torch.inference_mode()
    def _capture(self) -> None:
        self.capture_stream = torch.cuda.Stream()  # kept (model/graphs.py says why)
        self.graph, self.tokens = capture_graph(self._body, self.capture_stream)

    @torch.inference_mode()
    def encode(self, window: np.ndarray) -> np.ndarray:
        """One chunk's int16 timeline window (window_samples,) -> float32 tokens (n_audio_tokens, audio_dim)."""
        if not isinstance(window, np.ndarray) or window.dtype != np.int16 or window.shape != (self.window_samples,):
            raise ValueError(f"audio window must be {self.window_samples} int16 samples, got "
                             f"{getattr(window, 'dtype', type(window).__name__)} {getattr(window, 'shape', '')}")
        self.samples.copy_(torch.from_numpy(window)[None])
        self.graph.replay()
        return self.tokens.cpu().numpy()  # a copy: the next replay overwrites the static tokens
