"""The audio encoder on the GPU (``ConditioningConfig.device``, where a layout puts it beside the
decoder) gives the CPU's tokens. Skipped without CUDA."""

import numpy as np
import pytest
import torch

from charstream.stages.conditioning.stage import build
from charstream.stages.config import ConditioningConfig
from charstream.timeline import SAMPLES_PER_CHUNK

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("preset, weights", [("tiny", "packaged"), ("characters-14b", None)])
def test_encoder_on_the_gpu_gives_the_cpus_tokens(preset, weights):
    cpu = build(ConditioningConfig(device="cpu"), preset, weights)
    gpu = build(ConditioningConfig(device="cuda:0"), preset, weights)
    rng = np.random.default_rng()
    window = np.zeros(cpu.context + SAMPLES_PER_CHUNK + cpu.lookahead, np.int16)
    for _ in range(3):  # fresh speech-like windows: noise shaped by a slow envelope
        n = len(window)
        window = (rng.standard_normal(n) * 6000 * np.abs(np.sin(np.linspace(0, rng.uniform(2, 9), n)))).astype(np.int16)
        want, got = cpu.encode(window), gpu.encode(window)
        assert got.shape == want.shape and np.isfinite(got).all()
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < 2e-3, rel  # TF32 / cuDNN against fp32 CPU math


@pytest.mark.parametrize("preset, weights", [("tiny", "packaged"), ("characters-14b", None)])
def test_graphed_encode_equals_the_eager_encode_on_the_gpu(preset, weights):
    """Replayed (``conditioning.graphed``, the default) = eager on the same GPU, for fresh windows in
    turn: the static buffers carry nothing from one window to the next."""
    eager = build(ConditioningConfig(device="cuda:0", graphed=False), preset, weights)
    graphed = build(ConditioningConfig(device="cuda:0"), preset, weights)
    rng = np.random.default_rng()
    n = eager.context + SAMPLES_PER_CHUNK + eager.lookahead
    outputs = []
    for _ in range(4):
        window = (rng.standard_normal(n) * rng.uniform(300, 9000)).astype(np.int16)
        want, got = eager.encode(window), graphed.encode(window)
        assert got.shape == want.shape and np.isfinite(got).all()
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < 1e-3, rel  # the same kernels, replayed
        outputs.append(got)
    assert not np.shares_memory(outputs[0], outputs[1])  # each call's tokens are its own
    assert np.linalg.norm(outputs[0] - outputs[1]) > 0.01 * np.linalg.norm(outputs[0])
    with pytest.raises(ValueError, match="int16"):
        graphed.encode(np.zeros(n, np.float32))
    with pytest.raises(ValueError, match="int16"):
        graphed.encode(np.zeros(n - 1, np.int16))
