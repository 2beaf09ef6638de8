"""kvpot: read contexts far beyond a model's window in KV memory that does not grow with them.

Names are imported lazily (PEP 562) so that `kvpot --help` and `import kvpot.errors` do not pay
for torch and transformers.
"""

from importlib import import_module

from kvpot.errors import KvpotError

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "kvpot.engine",
    "Result": "kvpot.engine",
    "ScoreResult": "kvpot.engine",
    "State": "kvpot.engine",
    "Stats": "kvpot.engine",
    "METHODS": "kvpot.methods",
    "Method": "kvpot.methods",
    "make_method": "kvpot.methods",
    "Full": "kvpot.methods",
    "Truncate": "kvpot.methods",
    "StreamingLLM": "kvpot.methods",
    "H2O": "kvpot.methods",
    "TOVA": "kvpot.methods",
    "SnapKV": "kvpot.methods",
    "InfiniPot": "kvpot.methods",
    "InfiniteHiP": "kvpot.methods",
    "InfLLM": "kvpot.methods",
    "CItruS": "kvpot.methods",
    "D2O": "kvpot.methods",
    "SirLLM": "kvpot.methods",
    "CaM": "kvpot.methods",
    "PyramidKV": "kvpot.methods",
    "Scissorhands": "kvpot.methods",
    "RoCo": "kvpot.methods",
    "SelfExtend": "kvpot.methods",
    "REFERENCE_MODEL": "kvpot.models.reference",
    "SMOLLM2_135M": "kvpot.models",
}
_SUBPACKAGES = ("models", "methods", "tasks")  # `kvpot.models.SMOLLM2_135M` works after `import kvpot`

__all__ = ["KvpotError", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return import_module(f"kvpot.{name}")
    raise AttributeError(f"module 'kvpot' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
