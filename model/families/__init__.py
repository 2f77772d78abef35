"""Model families served by charstream, by name (``get_family``): the characters presets (``tiny``,
``characters-57b``, ...; one kind of model, a KV ring) and SoulX-FlashHead's variants (``flashhead-pro``,
``flashhead-lite``; chunks continued through motion latents)."""

from __future__ import annotations

from typing import Any

from charstream.model.config import PRESETS
from charstream.model.families.base import ModelFamily

FLASHHEAD_NAMES = ("flashhead-pro", "flashhead-lite")
FAMILY_NAMES = (*PRESETS, *FLASHHEAD_NAMES)


def get_family(name: str, **options: Any) -> ModelFamily:
    """The family ``name`` (one variant of it); ``options`` go to its class (FlashHead: ``audio_encoder``,
    ``config``)."""
    if name in PRESETS:
        from charstream.model.families.characters import CharactersFamily

        return CharactersFamily(name, **options)
    if name not in FLASHHEAD_NAMES:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(FAMILY_NAMES)})")
    # its modules (and torch work at import) load only when a FlashHead family is asked for
    from charstream.model.families.flashhead.family import FlashHeadFamily

    return FlashHeadFamily(name.removeprefix("flashhead-"), **options)
