"""A chunk's RGB frames as yuv420p, the pixel format the WebRTC video encoders take, made by PyAV's scaler.

Playout converts a chunk's frames on a worker thread after the chunk arrives, when its output's reader
asked for them (``PlayoutOutput.video_format``): the event loop that runs a session's stages and its
WebRTC send loops then only wraps each released frame, where it converted each one (a 512 x 512 frame
is ~1 ms of scaler work, 25 times a second per session).
"""

from __future__ import annotations

import numpy as np
from av import VideoFrame
from av.video.reformatter import VideoReformatter

FORMAT = "yuv420p"


class Yuv420Converter:
    def __init__(self) -> None:
        # one kept scaler: PyAV's VideoFrame.reformat makes a context per frame (~4 ms at 512 x 512)
        self._scaler = VideoReformatter()

    @staticmethod
    def fits(frames: np.ndarray) -> bool:
        """Whether ``frames`` (n, H, W, 3) can be yuv420p: chroma is subsampled 2 x 2, so H and W are even."""
        return frames.ndim == 4 and frames.shape[3] == 3 and frames.shape[1] % 2 == 0 and frames.shape[2] % 2 == 0

    def convert(self, frames: np.ndarray) -> np.ndarray:
        """uint8 (n, H, W, 3) RGB -> uint8 (n, H * 3 / 2, W): each frame's Y, U and V planes, stacked as
        ``VideoFrame.to_ndarray`` gives them. One call at a time per converter."""
        n, height, width, _ = frames.shape
        out = np.empty((n, height * 3 // 2, width), np.uint8)
        for i, frame in enumerate(frames):
            yuv = self._scaler.reformat(VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"),
                                        format=FORMAT)
            flat, at = out[i].reshape(-1), 0
            for plane in yuv.planes:  # Y, then U, then V, each without its rows' padding
                rows = np.frombuffer(plane, np.uint8).reshape(plane.height, plane.line_size)[:, :plane.width]
                flat[at:at + rows.size] = rows.reshape(-1)
                at += rows.size
        return out
