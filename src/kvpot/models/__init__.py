"""Which architectures kvpot runs, recognised by config class, and how to load them."""

from kvpot.models.support import (
    ARCHITECTURES,
    Architecture,
    architecture_of,
    default_dtype,
    load_pretrained,
    rotary_embedding,
)

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "architecture_of",
    "default_dtype",
    "load_pretrained",
    "rotary_embedding",
]
