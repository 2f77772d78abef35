"""The layer contract (pyproject.toml ``[tool.importlinter]``, docs/ARCHITECTURE.md, Layers) holds, and
an upward import breaks it.

The checkout itself is linted: ``charstream/<layer>`` are links to the card's folders, so grimp, mypy
and an editor resolve ``charstream.*`` from the repository. An injected violation is linted in a copy.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("charstream", "pipeline", "stages", "model", "kernels", "transport")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the tree at ``root``, with nothing but that tree on the path."""
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", str(root / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True,
                          timeout=120)


def copy_with(tmp_path: Path, inject: dict[str, str]) -> Path:
    """A copy of the packages (links kept) with ``inject`` (path → source line) appended."""
    tree = tmp_path / "tree"
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, tree / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
    for relative, line in inject.items():
        with (tree / relative).open("a") as f:
            f.write(f"\n{line}\n")
    return tree


def test_the_tree_keeps_the_layer_contract():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Layers run one way KEPT" in proc.stdout
    assert "Serving never imports training KEPT" in proc.stdout
    assert "Nothing below the application imports a benchmark KEPT" in proc.stdout
    # It read every folder through its link, not only charstream/ (the root package alone).
    modules = sum(len(list((ROOT / folder).rglob("*.py"))) for folder in PACKAGE_FOLDERS)
    assert f"Analyzed {modules} files" in proc.stdout, proc.stdout


@pytest.mark.parametrize(("inject", "contract", "chain"), [
    ({"kernels/rope.py": "from charstream.model import config  # noqa: E402, F401"},
     "Layers run one way", "charstream.kernels.rope -> charstream.model.config"),
    ({"pipeline/serve.py": "from charstream.pipeline.training import train  # noqa: E402, F401"},
     "Serving never imports training", "charstream.pipeline.serve -> charstream.pipeline.training.train"),
    ({"pipeline/runtime/engine.py": "from charstream.pipeline.bench import output  # noqa: E402, F401"},
     "Nothing below the application imports a benchmark",
     "charstream.pipeline.runtime.engine -> charstream.pipeline.bench.output"),
], ids=["kernels-imports-model", "serve-imports-training", "runtime-imports-bench"])
def test_an_upward_import_breaks_the_contract_and_is_named(tmp_path, inject, contract, chain):
    proc = lint_imports(copy_with(tmp_path, inject))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{contract} BROKEN" in proc.stdout
    assert chain in proc.stdout, proc.stdout
