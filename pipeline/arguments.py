"""argparse types and readers the commands share: a bad value is an error naming the option, before anything starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from charstream.stages.config import check_port

if TYPE_CHECKING:
    from charstream.model.families.base import ModelFamily


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def port(text: str) -> int:
    """A listener's TCP port (0 picks a free one)."""
    value = _whole_number(text)
    try:
        check_port(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1, e.g. ``1,2,4``."""
    return [positive_int(part) for part in text.split(",")]


def names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices``."""
    known = sorted(choices)

    def parse(text: str) -> list[str]:
        parts = text.split(",")
        unknown = [part for part in parts if part not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(known)}")
        return parts

    return parse


def read_portrait(path: str | Path) -> np.ndarray:
    """The portrait a chunk-motion model animates: an image file (PNG, JPEG, ... as FFmpeg reads them) as RGB
    uint8 (H, W, 3); a missing or unreadable file is a ValueError naming it."""
    import av

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--portrait {path}: no such file")
    try:
        with av.open(str(path)) as container:
            frame = next(container.decode(video=0))
            image = frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, StopIteration, ValueError) as e:
        raise ValueError(f"--portrait {path}: not an image ({e or 'no picture in it'})") from None
    if min(image.shape[:2]) < 16:
        raise ValueError(f"--portrait {path}: {image.shape[1]}x{image.shape[0]} is too small for a face")
    return image


def model_choice(name: str, weights: str | None, portrait: str | None) -> tuple[str | None, np.ndarray | None]:
    """``--model NAME --weights ... --portrait IMAGE`` checked together: the weights a session loads and the
    portrait it animates (None for a model that animates none). A chunk-motion model (FlashHead) needs its
    weights folder, checked from its file headers, or ``random``, and a portrait; a ValueError names what
    is wrong."""
    from charstream.model.families import get_family

    family = get_family(name)
    if family.generation_mode != "chunk_motion":
        if portrait is not None:
            raise ValueError(f"--portrait: model {name!r} animates its own character, not a portrait")
        return weights, None
    weights = model_weights(name, weights)
    if portrait is None:
        raise ValueError(f"--model {name} needs --portrait IMAGE (the face it animates)")
    return weights, read_portrait(portrait)


def model_weights(name: str, weights: str | None) -> str | None:
    """``--weights`` of model ``name`` as its sessions load them: a chunk-motion model's (FlashHead) folder,
    checked from its file headers, or None for ``random`` (seeded random weights); another model's as
    given (``packaged``, ``random`` or a file). A ValueError names what is wrong."""
    from charstream.model.families import get_family

    family = get_family(name)
    if family.generation_mode != "chunk_motion":
        return None if weights == "random" else weights
    if weights in (None, "packaged"):
        raise ValueError(f"--model {name} needs --weights DIR (its released folder) or --weights random")
    if weights != "random":
        report = family.inspect(weights)  # a missing or truncated file raises, naming it
        if not report.ok:
            raise ValueError(f"--weights {weights}: {report.problem()}")
    return None if weights == "random" else weights


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """``--blocks``, ``--size`` and ``--vae-width``: a smaller FlashHead model of the same architecture, to
    check a command end to end on a CPU (``sized_family`` takes them)."""
    parser.add_argument("--blocks", type=int, default=None, help="fewer FlashHead DiT blocks (a CPU check)")
    parser.add_argument("--size", type=int, default=None, help="another square FlashHead video size (a CPU check)")
    parser.add_argument("--vae-width", type=float, default=None,
                        help="the FlashHead VAE's channels as a fraction of the released one's, random weights "
                             "only (a CPU check)")


def sized_family(name: str, blocks: int | None = None, size: int | None = None,
                 vae_width: float | None = None) -> ModelFamily:
    """The family ``name``, with fewer DiT blocks, another square video size or a narrower VAE when given (a
    FlashHead model on the CPU, to check a bench end to end); a ValueError for a family that has no such sizes."""
    from charstream.model.families import get_family

    family = get_family(name)
    if not blocks and not size and not vae_width:
        return family
    if family.generation_mode != "chunk_motion":
        raise ValueError(f"--blocks, --size and --vae-width resize a FlashHead model, not {name!r}")
    if vae_width is not None and not 0 < vae_width <= 1:
        raise ValueError(f"--vae-width is a fraction in (0, 1], got {vae_width}")
    cfg = family.config
    return get_family(name, config=cfg.with_(n_blocks=blocks or cfg.n_blocks, height=size or cfg.height,
                                            width=size or cfg.width, vae_width=vae_width or cfg.vae_width))


def renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Refuse option ``old`` with one line naming ``new``, the option it became."""

    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            parser.exit(2, f"{parser.prog}: {old} is now {new}\n")

    parser.add_argument(old, action=Refuse, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
