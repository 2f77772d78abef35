"""The one error a SoulX-FlashHead checkpoint file raises when it cannot be used."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint file that is missing, truncated or does not match the model: names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
