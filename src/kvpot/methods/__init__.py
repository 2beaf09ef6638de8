"""Every method kvpot implements, by CLI name. Adding a method: one file plus a row here."""

from __future__ import annotations

import dataclasses
import typing

from kvpot.errors import KvpotError
from kvpot.methods.base import EvictionMethod, Method, Step
from kvpot.methods.cam import CaM
from kvpot.methods.citrus import CItruS
from kvpot.methods.d2o import D2O
from kvpot.methods.full import Full
from kvpot.methods.h2o import H2O
from kvpot.methods.infinipot import InfiniPot
from kvpot.methods.infinitehip import InfiniteHiP
from kvpot.methods.infllm import InfLLM
from kvpot.methods.pyramidkv import PyramidKV
from kvpot.methods.roco import RoCo
from kvpot.methods.scissorhands import Scissorhands
from kvpot.methods.selfextend import SelfExtend
from kvpot.methods.sirllm import SirLLM
from kvpot.methods.snapkv import SnapKV
from kvpot.methods.streaming import StreamingLLM
from kvpot.methods.tova import TOVA
from kvpot.methods.truncate import Truncate

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (Full, Truncate, StreamingLLM, H2O, TOVA, SnapKV, InfiniPot, CItruS, D2O, InfiniteHiP,
                             SirLLM, CaM, PyramidKV, Scissorhands, RoCo, SelfExtend, InfLLM)
}


def make_method(name: str, budget: int | None = None, **overrides: object) -> Method:
    """Build a method from its CLI name, an optional `--budget`, and `--set key=value` overrides.

    String values (from the command line) are converted to the field's type.
    """
    cls = METHODS.get(name)
    if cls is None:
        raise KvpotError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}.")
    fields = {f.name: f for f in cls.parameters()}
    hints = typing.get_type_hints(cls)
    converted = {}
    for key, value in overrides.items():
        if key not in fields:
            raise KvpotError(f"{name}: unknown parameter {key!r}; it takes: {', '.join(fields)}.")
        converted[key] = _convert(name, key, value, hints.get(key, str))
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise KvpotError(f"the budget must be a positive number of KV entries, got {budget!r}.")
        try:
            return cls.from_budget(budget, **converted)
        except TypeError:
            raise BudgetConflict(
                f"{name}: --budget sets {', '.join(_budget_fields(cls, budget))} already; "
                f"give either --budget or --set for {', '.join(converted)}, not both."
            ) from None
    try:
        return cls(**converted)
    except TypeError as err:
        raise KvpotError(f"{name}: {err}") from None


class BudgetConflict(KvpotError):
    """A parameter given explicitly is also one `--budget` derives (`--budget 128 --set window=60`)."""


def _budget_fields(cls: type[Method], budget: int) -> list[str]:
    """The parameters `from_budget` sets (those that differ from the defaults)."""
    made, default = cls.from_budget(budget), cls()
    return [f.name for f in cls.parameters() if getattr(made, f.name) != getattr(default, f.name)]


def _convert(method: str, key: str, value: object, hint) -> object:
    if not isinstance(value, str):
        return value
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if value.lower() == "none" and type(None) in typing.get_args(hint):
        return None
    for kind in kinds:
        try:
            if kind is bool:
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
                raise ValueError(value)
            if kind in (int, float, str):
                return kind(value)
        except ValueError:
            continue
    raise KvpotError(f"{method}: {key}={value!r} is not a valid {' or '.join(k.__name__ for k in kinds)}.")


def describe() -> list[dict]:
    """One row per method: name, class, paper, parameters with defaults, memory bound."""
    rows = []
    for name, cls in METHODS.items():
        params = {f.name: f.default for f in cls.parameters() if f.default is not dataclasses.MISSING}
        rows.append({"name": name, "class": cls.__name__, "paper": cls.paper, "parameters": params, "bound": cls.bound})
    return rows


__all__ = [
    "METHODS", "BudgetConflict", "CItruS", "CaM", "D2O", "EvictionMethod", "Full", "H2O", "InfiniPot", "InfiniteHiP",
    "InfLLM", "Method", "PyramidKV", "RoCo", "Scissorhands", "SelfExtend", "SirLLM", "SnapKV", "Step", "StreamingLLM",
    "TOVA", "Truncate", "describe", "make_method",
]
