"""kvpot's methods at compression ratios (`kvpot eval --compression-ratios 0.25,0.5,0.75`), as kvpress reports presses.

kvpress' leaderboard plots a score against the compression ratio r: a press keeps `int(n * (1 - r))` of
a prompt's n context entries per layer and KV head. To put kvpot's methods on the same axis, a method
that takes a budget runs once per ratio, labelled `name@r`, and each case builds it with
`--budget int(n * (1 - r))` for that case's own n (special prefix or chat template included, as the
press sees them), so a method and a press at the same r keep the same number of entries of the same
prompt. What a method holds beyond its budget (a chunk being read, its question, generated tokens)
is its own bound, `kvpot methods`. Methods that take no budget (`full`) run once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpot.errors import KvpotError


def parse_ratios(text: str) -> list[float]:
    """`--compression-ratios 0.25,0.5,0.75` as sorted, distinct fractions in (0, 1)."""
    ratios = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            ratio = float(part)
        except ValueError:
            raise KvpotError(f"--compression-ratios: {part!r} is not a number; give fractions such as "
                             "0.25,0.5,0.75.") from None
        if not 0.0 < ratio < 1.0:
            raise KvpotError(f"--compression-ratios: {part} is outside (0, 1); a ratio is the share of the "
                             "context's entries evicted.")
        ratios.add(ratio)
    if not ratios:
        raise KvpotError("--compression-ratios is empty; give fractions such as 0.25,0.5,0.75.")
    return sorted(ratios)


def kept_entries(context_tokens: int, ratio: float) -> int:
    """kvpress' `int(n * (1 - ratio))`, at least 1 (the budget a method gets at this ratio)."""
    return max(1, int(context_tokens * (1.0 - ratio)))


def ratio_label(label: str, ratio: float) -> str:
    return f"{label}@{ratio:g}"


@dataclass
class RatioRun:
    """One kvpot method at one compression ratio: the method is built per case, from the case's length."""

    label: str
    spec: object  # kvpot.methods.spec.MethodSpec
    ratio: float
    settings: dict = field(default_factory=dict)
    _built: dict = field(default_factory=dict, repr=False)

    def method_for(self, context_tokens: int):
        budget = kept_entries(context_tokens, self.ratio)
        if budget not in self._built:
            from kvpot.methods.spec import build_methods

            self._built[budget] = build_methods([self.spec], budget, self.settings)[0].method
        return self._built[budget]

    def describe(self, context_tokens: int | None = None) -> dict:
        """What summaries record: the spec, the ratio, the rule, and the method as built for `context_tokens`."""
        out = {"spec": self.spec.text(), "compression_ratio": self.ratio, "family": self.spec.text(),
               "budget_rule": "int(n * (1 - ratio)) of each case's n context tokens"}
        if context_tokens:
            method = self.method_for(context_tokens)
            out.update(config=method.config(), max_entries=method.max_entries(), config_at_tokens=context_tokens)
        else:
            out.update(config={}, max_entries=None)
        return out


def ratio_runs(specs, ratios: list[float], settings: dict, budget: int | None, probe_tokens: int) -> list:
    """Every method at every ratio (`RatioRun`), or once (`MethodRun`) when it takes no budget.

    Each method is built once at `probe_tokens` context tokens (the shortest length asked), so a spec it
    refuses fails before any model is loaded."""
    from kvpot.methods import METHODS
    from kvpot.methods.spec import MethodRun, build_methods, method_labels, takes_budget

    build_methods(specs, None, settings)  # unknown methods, and --set keys no method has, fail as without ratios
    if budget is not None:
        raise KvpotError("--budget and --compression-ratios exclude each other: at a ratio each case's budget "
                         "is int(n * (1 - ratio)) of its n context tokens.")
    runs = []
    for label, spec in zip(method_labels(specs), specs):
        if "budget" in spec.overrides:
            raise KvpotError(f"--method {spec.text()}: budget= and --compression-ratios exclude each other.")
        params = {f.name for f in METHODS[spec.name].parameters()}
        own = {k: v for k, v in settings.items() if k in params}  # as build_methods shares --set among several
        if not takes_budget(spec.name):
            runs.append(MethodRun(label, spec, build_methods([spec], None, own)[0].method))
            continue
        for ratio in ratios:
            run = RatioRun(ratio_label(label, ratio), spec, ratio, own)
            run.method_for(probe_tokens)
            runs.append(run)
    return runs
