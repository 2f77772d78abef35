"""Shared pytest fixtures."""

import sys
from pathlib import Path

import pytest
import torch

from charstream.logs import configure_logging
from charstream.model.threads import set_intra_op_threads


@pytest.fixture(autouse=True, scope="session")
def logging_configured_at_start():
    """Configure this process's logging once, before any test, as every charstream process does at its start.

    Configuration is once per process (later calls are no-ops). A test running a command in-process
    (``main(["demo", ...])``, which configures logging at ``error``) would otherwise fix the level for
    every later test, filtering the warnings a test reads from its captured stderr."""
    configure_logging()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops: one thread is as fast, and does not collapse when other jobs share the CPU."""
    previous = torch.get_num_threads()
    set_intra_op_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def user_folder(tmp_path_factory) -> Path:
    """A folder holding a user's own ``model.py``, ``pipeline.py`` and ``transport/``, each raising when
    imported: a command run there (``python -m`` puts it first on ``sys.path``) fails if any import
    reaches them instead of ``charstream.*``."""
    folder = tmp_path_factory.mktemp("user-project")
    for relative in ("model.py", "pipeline.py", "transport/__init__.py"):
        path = folder / relative
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"raise ImportError('the user\\'s own {relative} was imported')\n")
    return folder


@pytest.fixture(autouse=True, scope="module")
def release_shared_models():
    """A serving process keeps the FlashHead models its sessions share for its lifetime; the test process
    lets them go after each module, as it would the models a test built itself."""
    yield
    family = sys.modules.get("charstream.model.families.flashhead.family")
    if family is not None:
        family._SHARED.clear()
