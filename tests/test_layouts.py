import pytest

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.layouts import LAYOUTS, apply_layout


def test_reference_session_layout():
    cfg = apply_layout(PipelineConfig(preset="characters-57b"), "3+1", gpus_available=4)
    assert cfg.diffusion.tp == 3 and cfg.diffusion.devices == ["cuda:0", "cuda:1", "cuda:2"]
    assert cfg.decode.device == "cuda:3" and cfg.hosting == "processes" and cfg.diffusion.fp8_cache
    assert cfg.conditioning.device == "cuda:3"  # the audio encoder beside the decoder, off the edge's CPU
    assert apply_layout(PipelineConfig(), "cpu").conditioning.device == "cpu"


def test_every_layout_splits_the_57b_heads():
    for name in LAYOUTS:
        apply_layout(PipelineConfig(preset="characters-57b"), name)


def test_shared_decoder_gpu():
    layout = LAYOUTS["3"]
    assert layout.gpus == 3 and layout.decoder in layout.diffusion


def test_bad_layouts_fail_clearly():
    with pytest.raises(ValueError, match="needs 5 GPUs"):
        apply_layout(PipelineConfig(), "4+1", gpus_available=4)
    with pytest.raises(ValueError, match="unknown layout"):
        apply_layout(PipelineConfig(), "5+1")


def test_a_chunk_model_stays_in_the_session_process_on_one_gpu():
    """FlashHead's diffusion and decode share one chunk stream: layout 1 puts it on cuda:0, in process."""
    cfg = apply_layout(PipelineConfig(preset="flashhead-pro"), "1")
    assert cfg.hosting == "inproc" and cfg.diffusion.device == "cuda:0" and cfg.conditioning.device == "cuda:0"
    with pytest.raises(ValueError, match="runs on one GPU"):
        apply_layout(PipelineConfig(preset="flashhead-pro"), "3+1")
