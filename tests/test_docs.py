"""The documents name only what exists: every repository path, link and ``charstream.*`` name in
README.md, docs/**/*.md, kernels/README.md and the examples' docstrings resolves, and the README's
Python snippets import what they use and call it as it is defined. The checker itself is shown to
fail on an injected stale path, name, import and call."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a path is a repository path when its first folder is one of these (outputs such as DIR/report.md
# or /tmp/x are not)
TOP_FOLDERS = ("docs", "pipeline", "stages", "model", "kernels", "transport", "tests", "scripts", "examples")
PATH = re.compile(r"(?<![\w/.~-])(?:" + "|".join(TOP_FOLDERS) + r")/[\w./*\-]*[\w*/]")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"(?<![\w.])charstream(?:\.[A-Za-z_]\w*)+")
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
# what a snippet of an integration may use: a name of these called but not imported is a stale snippet
INTEGRATION_MODULES = ("charstream.pipeline.config", "charstream.pipeline.integrations.embedded",
                       "charstream.pipeline.integrations.pipecat", "charstream.pipeline.integrations.livekit",
                       "charstream.pipeline.integrations.livekit_plugin")


@functools.cache
def documents() -> dict[str, str]:
    """Each checked document's text by its repository path (an example: its module docstring)."""
    paths = [ROOT / "README.md", ROOT / "kernels" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in paths}
    for example in sorted((ROOT / "examples").glob("*.py")):
        texts[str(example.relative_to(ROOT))] = ast.get_docstring(ast.parse(example.read_text())) or ""
    return texts


def stale_paths(text: str, where: Path) -> list[str]:
    """Repository paths (from the root, ``*`` as a glob) and relative links (from ``where``'s folder)
    that name nothing in the checkout."""
    missing = []
    for path in {m.group(0).removesuffix("**").rstrip(".") for m in PATH.finditer(text)}:  # not bold, not a stop
        if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
            missing.append(path)
    for target in {m.group(1) for m in LINK.finditer(text)}:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        if not (where.parent / target.split("#")[0]).exists():
            missing.append(target)
    return sorted(missing)


def resolve(dotted: str) -> object:
    """The module or module attribute a dotted ``charstream.*`` name denotes; raises if none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is not None and not ".".join(parts[:cut]).startswith(e.name):
                raise  # the module exists but needs something that is not installed
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def stale_names(text: str) -> list[str]:
    missing = []
    for name in sorted({m.group(0) for m in DOTTED.finditer(text)}):
        if any(re.fullmatch(r"[A-Z]", part) for part in name.split(".")):
            continue  # a pattern such as charstream.X.y, not a name
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    return missing


def snippet_problems(source: str) -> list[str]:
    """What a Python snippet imports that does not exist, and its calls of what it imported from
    charstream (and of methods of what it built from them) that the signatures refuse."""
    tree = compile(source, "<snippet>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    problems: list[str] = []
    imported: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            try:
                module = importlib.import_module(node.module or "")
            except ImportError as e:
                problems.append(f"from {node.module} import ...: {e}")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    problems.append(f"{node.module} has no {alias.name}")
                elif node.module.startswith("charstream"):
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as e:
                    problems.append(f"import {alias.name}: {e}")
    bound = set(imported) | {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                             if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in bound:
            homes = [m for m in INTEGRATION_MODULES if hasattr(importlib.import_module(m), node.func.id)]
            if homes:
                problems.append(f"calls {node.func.id} without importing it (from {homes[0]})")
    built: dict[str, object] = {}  # variable -> the charstream class it was built from
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and inspect.isclass(imported.get(node.value.func.id))):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    built[target.id] = imported[node.value.func.id]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, label = None, ast.unparse(node.func)
        if isinstance(node.func, ast.Name) and node.func.id in imported:
            func = imported[node.func.id]
        elif (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id in built):
            cls = built[node.func.value.id]
            if not hasattr(cls, node.func.attr):
                problems.append(f"{cls.__name__} has no {node.func.attr}")
                continue
            func = getattr(cls, node.func.attr)
        if func is None or not callable(func):
            continue
        signature = inspect.signature(func)
        if isinstance(node.func, ast.Attribute):  # a method looked up on the class: drop self
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        try:
            signature.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg})
        except TypeError as e:
            problems.append(f"{label}{signature}: {e}")
    return problems


@pytest.mark.parametrize("name", sorted(documents()))
def test_every_path_and_link_exists(name):
    assert stale_paths(documents()[name], ROOT / name) == []


@pytest.mark.parametrize("name", sorted(documents()))
def test_every_charstream_name_resolves(name):
    assert stale_names(documents()[name]) == []


def test_readme_snippets_import_and_call_what_exists():
    snippets = PYTHON_BLOCK.findall((ROOT / "README.md").read_text())
    assert snippets, "the README has Python snippets"
    for snippet in snippets:
        assert snippet_problems(snippet) == []


SAMPLE_DIR = ROOT / "docs" / "SAMPLE.md"  # where the sample text pretends to live


def test_the_checker_finds_stale_paths_and_names():
    good = ("See `pipeline/config.py`, docs/ARCHITECTURE.md, [the design](ARCHITECTURE.md#layers), "
            "[a site](https://example.org), `docs/quality/gate_*/REPORT.md`, output in `DIR/report.md`, "
            "``charstream.pipeline.config.PipelineConfig`` and charstream.stages.playout.stage.")
    assert stale_paths(good, SAMPLE_DIR) == []
    assert stale_names(good) == []
    stale = ("`pipeline/bench_nothing.py`, see docs/NOTES.md and [it](NOTES.md), and "
             "``charstream.pipeline.no_such_module`` beside charstream.pipeline.config.NoSuchConfig.")
    assert stale_paths(stale, SAMPLE_DIR) == ["NOTES.md", "docs/NOTES.md", "pipeline/bench_nothing.py"]
    assert stale_names(stale) == ["charstream.pipeline.config.NoSuchConfig", "charstream.pipeline.no_such_module"]


def test_the_checker_finds_a_stale_snippet():
    good = ("from charstream.pipeline.config import PipelineConfig\n"
            "from charstream.pipeline.integrations.embedded import EmbeddedSession\n"
            "session = EmbeddedSession(PipelineConfig(), 'room-1')\nawait session.start()\n")
    assert snippet_problems(good) == []
    missing_name = "from charstream.pipeline.integrations.livekit_plugin import EmbeddedSession\n"
    assert snippet_problems(missing_name) == ["charstream.pipeline.integrations.livekit_plugin has no EmbeddedSession"]
    wrong_call = ("from charstream.pipeline.integrations.livekit_plugin import AvatarSession\n"
                  "session = AvatarSession(config, room.name)\n")
    assert len(problems := snippet_problems(wrong_call)) == 1 and problems[0].startswith("AvatarSession(")
    wrong_method = good.replace("session.start()", "session.begin()")
    assert snippet_problems(wrong_method) == ["EmbeddedSession has no begin"]
    not_imported = "config = PipelineConfig()\navatar = CharstreamVideoService(EmbeddedSession(config, sid))\n"
    assert sorted(snippet_problems(not_imported)) == [
        "calls CharstreamVideoService without importing it (from charstream.pipeline.integrations.pipecat)",
        "calls EmbeddedSession without importing it (from charstream.pipeline.integrations.embedded)",
        "calls PipelineConfig without importing it (from charstream.pipeline.config)"]
