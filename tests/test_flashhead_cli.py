"""``charstream serve/demo --model flashhead-pro``: the portrait read from an image file, and every missing or
bad piece refused in one line before anything starts."""

import av
import numpy as np
import pytest

from charstream.pipeline.arguments import read_portrait
from charstream.pipeline.cli import main


def write_png(path, image: np.ndarray) -> None:
    with av.open(str(path), "w", format="image2") as container:
        stream = container.add_stream("png")
        stream.width, stream.height, stream.pix_fmt = image.shape[1], image.shape[0], "rgb24"
        for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_a_portrait_is_read_as_rgb(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    write_png(tmp_path / "face.png", image)
    assert np.array_equal(read_portrait(tmp_path / "face.png"), image)


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_flashhead_options_are_checked_in_one_line(command, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a face")
    write_png(tmp_path / "face.png", np.zeros((32, 32, 3), np.uint8))
    cases = [
        (["--weights", "random"], "--model flashhead-pro needs --portrait IMAGE"),
        (["--portrait", str(tmp_path / "face.png")], "--model flashhead-pro needs --weights DIR"),
        (["--weights", "random", "--portrait", str(tmp_path / "absent.png")], "absent.png: no such file"),
        (["--weights", "random", "--portrait", str(tmp_path / "notes.txt")], "notes.txt: not an image"),
        (["--weights", str(tmp_path), "--portrait", str(tmp_path / "face.png")], "Model_Pro: missing"),
    ]
    for options, said in cases:
        assert main([command, "--model", "flashhead-pro", *options]) == 2
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"charstream {command}: ") and said in lines[0], lines


def test_demo_hears_the_scripted_user_unless_told_not_to(tmp_path):
    import argparse

    from charstream.pipeline import demo

    write_png(tmp_path / "face.png", np.zeros((32, 32, 3), np.uint8))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    common = ["--model", "flashhead-pro", "--weights", "random", "--portrait", str(tmp_path / "face.png")]
    assert demo.plan(parser.parse_args(common)).config.ingest.scripted_recognizer
    plan = demo.plan(parser.parse_args([*common, "--no-hear"]))
    assert not plan.config.ingest.scripted_recognizer and plan.portrait.shape == (32, 32, 3)
