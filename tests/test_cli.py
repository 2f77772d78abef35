import subprocess
import sys

from charstream.pipeline.cli import COMMANDS, build_parser


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "charstream", "--help"], capture_output=True, text=True, check=True)
    for words, _, _ in COMMANDS:
        assert words[0] in out.stdout


def test_every_command_has_a_parser():
    _, leaves = build_parser()
    assert set(leaves) == {words for words, _, _ in COMMANDS}
