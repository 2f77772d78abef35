"""Model families served by charstream, by name (``get_family``)."""

from __future__ import annotations

from typing import Any

from charstream.model.families.base import ModelFamily

FAMILY_NAMES = ("flashhead-pro", "flashhead-lite")


def get_family(name: str, **options: Any) -> ModelFamily:
    """The family ``name`` (one variant of it); ``options`` go to its class (FlashHead: ``audio_encoder``)."""
    if name not in FAMILY_NAMES:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(FAMILY_NAMES)})")
    # its modules (and torch work at import) load only when a FlashHead family is asked for
    from charstream.model.families.flashhead.family import FlashHeadFamily

    return FlashHeadFamily(name.removeprefix("flashhead-"), **options)
