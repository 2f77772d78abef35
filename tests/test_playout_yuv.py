"""Playout's yuv420p conversion equals PyAV's own (what the video track would make), row padding included."""

import numpy as np
import pytest
from av import VideoFrame
from av.video.reformatter import VideoReformatter

from charstream.stages.playout.yuv import Yuv420Converter


@pytest.mark.parametrize("size", [(32, 32), (200, 200), (64, 136), (512, 512)])
def test_conversion_equals_pyavs_planes(size):
    height, width = size  # 200 and 136: chroma rows of 100 and 68 bytes, which the scaler pads
    frames = np.random.default_rng(height + width).integers(0, 256, (3, height, width, 3), dtype=np.uint8)
    scaler = VideoReformatter()
    want = np.stack([scaler.reformat(VideoFrame.from_ndarray(f, format="rgb24"), format="yuv420p").to_ndarray()
                     for f in frames])
    got = Yuv420Converter().convert(frames)
    assert got.shape == (3, height * 3 // 2, width) and np.array_equal(got, want)
    back = VideoFrame.from_numpy_buffer(got[1], format="yuv420p")  # what the track sends
    assert (back.width, back.height) == (width, height)


def test_only_even_sizes_fit():
    assert Yuv420Converter.fits(np.zeros((2, 16, 16, 3), np.uint8))
    assert not Yuv420Converter.fits(np.zeros((2, 15, 16, 3), np.uint8))
    assert not Yuv420Converter.fits(np.zeros((2, 16, 16, 4), np.uint8))
