"""``charstream bench chunk`` on the CPU at a reduced size: the parts of a chunk timed through the serving
objects, sessions side by side sharing one model -- each on its own stream, then batched by the stages'
batchers -- the table and JSON."""

import json
import time

import pytest

from charstream.model.families.flashhead import family as flashhead_family
from charstream.pipeline.arguments import sized_family
from charstream.pipeline.cli import main


def test_bench_chunk_times_the_parts_and_runs_sessions_side_by_side(tmp_path, capsys):
    out = tmp_path / "chunk.json"
    before = set(flashhead_family._SHARED)
    # Pro (its decode in two parts) with a quarter of the VAE's channels: the machinery, not the model's cost
    assert main(["bench", "chunk", "--model", "flashhead-pro", "--device", "cpu", "--blocks", "1", "--size", "32",
                 "--vae-width", "0.25",
                 "--chunks", "1", "--warmup", "0", "--sessions", "1,2", "--seconds", "0.2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    parts = report["one_session"]
    assert set(parts) == {"encode", "denoise", "decode", "decode_lead", "chunk"}
    assert 0 < parts["decode_lead"]["median_ms"] < parts["decode"]["median_ms"]  # the first 8 frames out first
    assert parts["chunk"]["median_ms"] >= parts["denoise"]["median_ms"] > 0
    # each part's rate: the family's count of its work over its median time (the lead part has no count)
    flops = report["flops_per_chunk"]
    counted = sized_family("flashhead-pro", 1, 32, 0.25).flops_per_chunk()  # the bench's model, counted apart
    assert flops == {"encode": counted["audio_encode"], "denoise": counted["denoise"],
                     "decode": counted["decode"] + counted["motion_encode"], "chunk": sum(counted.values())}
    for part in ("encode", "denoise", "decode", "chunk"):
        assert parts[part]["tflops"] == pytest.approx(flops[part] / parts[part]["median_ms"] / 1e9)
    assert "tflops" not in parts["decode_lead"]
    alone, threads, batched = report["side_by_side"]
    assert (alone["mode"], alone["sessions"]) == ("threads", 1)  # one session: on its own stream only
    assert threads["mode"] == "threads" and batched["mode"] == "batched"
    for ladder in (threads, batched):
        assert ladder["sessions"] == 2 and ladder["chunks"] >= 2 and ladder["generated_fps"] > 0
        assert ladder["model_tflops"] == pytest.approx(ladder["generated_fps"] / 28 * flops["chunk"] / 1e12)
    assert threads["largest_batch"] is None and batched["largest_batch"] in (1, 2)
    assert report["compiled"] is False and report["size"] == [32, 32] and report["blocks"] == 1
    assert report["vae_width"] == 0.25
    assert report["model"] == "flashhead-pro" and report["new_frames_per_chunk"] == 28
    # two sessions, one DiT + VAE and one audio encoder (its modules, and the encoder around them)
    assert sorted(key[0] for key in set(flashhead_family._SHARED) - before) == ["audio", "audio-encoder", "generator"]
    assert "keeps up" in capsys.readouterr().out


def test_a_failing_session_stops_the_side_by_side_run_with_its_error():
    """A session whose chunk raises ends the run with that error, not a wait for its first chunk."""
    from charstream.pipeline.bench.chunk import side_by_side

    class Session:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def run_chunk(self, batchers=None) -> dict:
            if self.fails:
                raise ValueError("the chunk failed")
            time.sleep(0.01)
            return {}

    with pytest.raises(RuntimeError, match="1 of 2 sessions") as raised:
        side_by_side([Session(False), Session(True)], 0.1, 1.0, 28)
    assert isinstance(raised.value.__cause__, ValueError)
