"""charstream works from a folder that holds a user's own ``model.py``, ``pipeline.py`` and ``transport/``.

The user's modules raise when imported, so any import that reaches them instead of ``charstream.*``
fails the run rather than passing by luck.
"""

import subprocess
import sys
from pathlib import Path

import pytest

import charstream

CHARSTREAM = Path(sys.executable).with_name("charstream")  # the console script beside this interpreter


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user-project")
    for relative in ("model.py", "pipeline.py", "transport/__init__.py"):
        path = folder / relative
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"raise ImportError('the user\\'s own {relative} was imported')\n")
    return folder


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


def test_demo_one_turn_exits_0(user_folder, tmp_path):
    out = tmp_path / "demo-out"
    proc = run(user_folder, str(CHARSTREAM), "demo", "--turns", "1", "--out", str(out), timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "session.mp4").stat().st_size > 0
    assert len((out / "trace.jsonl").read_text().splitlines()) == 1
