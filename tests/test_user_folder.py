"""charstream works from a folder that holds a user's own ``model.py``, ``pipeline.py`` and ``transport/``
(``conftest.user_folder``).

The user's modules raise when imported, so any import that reaches them instead of ``charstream.*``
fails the run rather than passing by luck. The demo runs there too: tests/test_demo.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest

import charstream

CHARSTREAM = Path(sys.executable).with_name("charstream")  # the console script beside this interpreter


def run(folder: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=timeout)


def test_user_modules_shadow_top_level_names(user_folder):
    # The guard itself: from this folder a bare ``import model`` does reach the user's file.
    proc = run(user_folder, sys.executable, "-c", "import model")
    assert proc.returncode != 0 and "the user's own model.py was imported" in proc.stderr, proc.stderr


def test_import_charstream_gives_the_public_api(user_folder):
    proc = run(user_folder, sys.executable, "-c",
               "import charstream; print(charstream.__version__, charstream.LiveSession)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == charstream.__version__ != "0.0.0+unknown"
    assert "<class 'charstream.pipeline.session.LiveSession'>" in proc.stdout


@pytest.mark.parametrize("command", [(sys.executable, "-m", "charstream"), (str(CHARSTREAM),)],
                         ids=["python-m", "console-script"])
def test_version(user_folder, command):
    proc = run(user_folder, *command, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"charstream {charstream.__version__}"
