"""kvpot: read contexts far beyond a model's window in KV memory that does not grow with them."""

from kvpot.engine import Engine, Result, State, Stats
from kvpot.errors import KvpotError
from kvpot.methods import (
    H2O,
    METHODS,
    TOVA,
    Full,
    Method,
    SnapKV,
    StreamingLLM,
    Truncate,
    make_method,
)

__version__ = "0.1.0"

__all__ = [
    "Engine", "Full", "H2O", "KvpotError", "METHODS", "Method", "Result", "SnapKV", "State", "Stats",
    "StreamingLLM", "TOVA", "Truncate", "make_method",
]
