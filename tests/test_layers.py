"""The layer contract (pyproject.toml ``[tool.importlinter]``, docs/ARCHITECTURE.md, Layers) holds, and
an upward import breaks it.

grimp reads one directory per package, and ``[tool.setuptools.package-dir]`` maps the card's sibling
folders under ``charstream``, so lint-imports runs on a non-editable install of a copy of the tree.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("charstream", "pipeline", "stages", "model", "kernels", "transport")
BUILD_FILES = ("pyproject.toml", "README.md")  # what the build reads besides the package folders


def lint_imports(tmp_path: Path, inject: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Copy the packages, add ``inject`` (path → source line appended), install it into a folder, lint it there."""
    tree, site = tmp_path / "tree", tmp_path / "site"
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, tree / name)
    for relative, line in (inject or {}).items():
        with (tree / relative).open("a") as f:
            f.write(f"\n{line}\n")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-compile", "--target", str(site), str(tree)], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    # cwd = the install folder: lint-imports puts cwd first on sys.path, and the repository root would
    # shadow the installed package with charstream/ (the root package alone).
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", str(tree / "pyproject.toml")],
                          cwd=site, env={"PYTHONPATH": str(site), "PATH": ""}, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_keeps_the_layer_contract(tmp_path):
    proc = lint_imports(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Layers run one way KEPT" in proc.stdout
    assert "Serving never imports training KEPT" in proc.stdout
    # It read every mapped folder, not only charstream/ (the root package alone).
    modules = sum(len(list((ROOT / folder).rglob("*.py"))) for folder in PACKAGE_FOLDERS)
    assert f"Analyzed {modules} files" in proc.stdout, proc.stdout


@pytest.mark.parametrize(("inject", "contract", "chain"), [
    ({"kernels/rope.py": "from charstream.model import config  # noqa: E402, F401"},
     "Layers run one way", "charstream.kernels.rope -> charstream.model.config"),
    ({"pipeline/serve.py": "from charstream.pipeline.training import train  # noqa: E402, F401"},
     "Serving never imports training", "charstream.pipeline.serve -> charstream.pipeline.training.train"),
], ids=["kernels-imports-model", "serve-imports-training"])
def test_an_upward_import_breaks_the_contract_and_is_named(tmp_path, inject, contract, chain):
    proc = lint_imports(tmp_path, inject)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{contract} BROKEN" in proc.stdout
    assert chain in proc.stdout, proc.stdout
