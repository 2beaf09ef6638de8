"""The driver of `kvpot bench hip-reference`: lengths x configurations x layer kinds, a table and results.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpot.bench.hip_mapping import CASES, MAPPING, UNMAPPED, get_case
from kvpot.errors import KvpotError


@dataclass
class HipReferenceConfig:
    out: Path
    lengths: list[int]
    cases: list[str] = field(default_factory=lambda: ["paper"])
    source: str = "random"  # "random" at --shape, or "model" (q/k/v captured from --model)
    shape: str = "llama3-8b"
    model: str | None = None
    layers: list[str] = field(default_factory=lambda: ["late"])  # "early" (first layers) and/or "late"
    model_layer: int | None = None  # the captured layer (default: 0 for early, the 4th for late)
    queries: int = 2048
    decode_steps: int = 64
    refresh: list[str] = field(default_factory=lambda: ["on", "off"])
    phases: list[str] = field(default_factory=lambda: ["prefill", "decode"])
    repeats: int = 5
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        for name in self.cases:
            get_case(name)
        if self.source not in ("random", "model"):
            raise KvpotError(f"hip-reference: --source is random or model, not {self.source!r}.")
        if self.source == "model" and not self.model:
            raise KvpotError("hip-reference: --source model needs --model (e.g. smollm2-135m).")
        if set(self.layers) - {"early", "late"} or set(self.refresh) - {"on", "off"} or \
                set(self.phases) - {"prefill", "decode"}:
            raise KvpotError("hip-reference: --layers early,late; --refresh on,off; --phases prefill,decode.")
        if self.queries % 64 or self.queries <= 0 or any(n <= self.queries for n in self.lengths):
            raise KvpotError("hip-reference: --queries must be a positive multiple of 64, below every length.")
        if self.decode_steps > self.queries:
            raise KvpotError("hip-reference: --decode-steps reuses the last queries; give at most --queries steps.")


def _inputs(config: HipReferenceConfig, n: int, early: bool, loaded):
    import torch

    from kvpot.bench.hip_inputs import model_inputs, random_inputs

    dtype = getattr(torch, config.dtype)
    if config.source == "random":
        return random_inputs(config.shape, n, config.queries, config.device, dtype, config.seed)
    model, tokenizer = loaded
    layer = config.model_layer if config.model_layer is not None else (0 if early else 3)
    return model_inputs(model, tokenizer, n, config.queries, layer, config.seed)


def _load_model(config: HipReferenceConfig):
    if config.source != "model":
        return None
    from kvpot.eval.common import load_model

    model, tokenizer, _, _ = load_model(config.model, config.device, config.dtype)
    return model, tokenizer


def run_hip_reference(config: HipReferenceConfig, progress: bool = True, hip=None) -> dict:
    """Every (length, layer kind, case) row; `hip`: hip-attn's entry points (default: `load_hip()`). A row that
    raises is recorded with its error (`"error"`) and the run goes on to the next one."""
    from kvpot.bench.common import checkpoint, machine
    from kvpot.bench.hip_reference import decode_row, prefill_row
    from kvpot.bench.hip_shim import load_hip

    hip = hip or load_hip()  # before any model: a missing piece costs nothing
    config.out.mkdir(exist_ok=True)
    results = {"complete": False, "machine": machine(config.device), "hip_attn": hip.version, "triton": hip.triton,
               "replaced_modules": hip.replaced, "mapping": MAPPING, "unmapped": UNMAPPED,
               "cases": {name: CASES[name].__dict__ for name in config.cases},
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()}, "rows": []}
    loaded = _load_model(config)

    def add(base: dict, measure) -> None:
        results["rows"].append({**base, **_guarded(measure, config.device)})
        _show(results["rows"][-1], progress)
        checkpoint(results, config.out)

    for n in config.lengths:
        for kind in config.layers:
            early = kind == "early"
            try:
                inputs = _inputs(config, n, early, loaded)
            except Exception as err:  # noqa: BLE001 - recorded in each of its rows
                for name in config.cases:
                    add({"length": n, "case": name, "layer": kind, "source": config.source, "phase": "inputs"},
                        lambda err=err: _raise(err))
                continue
            for name in config.cases:
                case = CASES[name]
                base = {"length": n, "case": name, "layer": kind, "source": inputs.source}
                if "prefill" in config.phases:
                    add({**base, "phase": "prefill", "queries": config.queries},
                        lambda: prefill_row(hip, case, inputs, early, config.device, config.repeats))
                for refresh in config.refresh if "decode" in config.phases else ():
                    add({**base, "phase": "decode", "mask_refresh": refresh, "steps": config.decode_steps},
                        lambda refresh=refresh: decode_row(hip, case, inputs, early, config.device,
                                                           config.decode_steps, refresh == "on"))
            inputs = None  # before the next length's
    results["complete"] = True
    results["errors"] = sum("error" in row for row in results["rows"])
    checkpoint(results, config.out)
    (config.out / "summary.md").write_text(summary(results), encoding="utf-8")
    return results


def _raise(err: Exception):
    raise err


def _guarded(measure, device: str) -> dict:
    """measure()'s row, or {"error": ..., "traceback": ...} when it raises (the GPU's memory released after)."""
    import traceback

    try:
        return measure()
    except Exception as err:  # noqa: BLE001 - one row's failure is that row's result
        row = {"error": f"{type(err).__name__}: {err}".strip(),
               "traceback": traceback.format_exception(type(err), err, err.__traceback__)[-6:]}
    if device.startswith("cuda"):
        import torch

        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001 - a broken context fails every later row, each recorded
            row["cuda_after"] = f"{type(err).__name__}: {err}"
    return row


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _line(row: dict) -> str:
    if "error" in row:
        mode = {"prefill": f"prefill q={row.get('queries')}", "inputs": "inputs"}.get(
            row["phase"], f"decode x{row.get('steps')} refresh {row.get('mask_refresh')}")
        text = row["error"].splitlines()[0] if row["error"] else "error"
        text = (text if len(text) <= 160 else text[:157] + "...").replace("|", "/")
        return f"| {row['length']} | {row['case']} | {row['layer']} | {mode} | **error**: {text} | - | - | - | - | - |"
    e = row["errors"]
    if row["phase"] == "prefill":
        recall = " ".join(f"s{s['stage']} {_fmt(s['recall'])}/{_fmt(s['precision'])}" for s in row["stages"])
        mode = f"prefill q={row['queries']}"
    else:
        recall = f"last {_fmt(row['last_stage_recall_mean'])} (min {_fmt(row['last_stage_recall_min'])})"
        mode = f"decode x{row['steps']} refresh {'/'.join(map(str, row['refresh']))}"
    return (f"| {row['length']} | {row['case']} | {row['layer']} | {mode} | {recall} | "
            f"{_fmt(e['kvpot_vs_dense']['max'], 4)} / {_fmt(e['kvpot_vs_dense']['mean'], 5)} | "
            f"{_fmt(e['hip_vs_dense']['max'], 4)} / {_fmt(e['hip_vs_dense']['mean'], 5)} | "
            f"{_fmt(e['kvpot_vs_hip']['max'], 4)} / {_fmt(e['kvpot_vs_hip']['mean'], 5)} | "
            f"{_fmt(row.get('kvpot_us'), 0)} | {_fmt(row.get('hip_us'), 0)} |")


HEADER = ("| keys | case | layer | phase | recall/precision of hip-attn's keys | kvpot vs dense max / mean | "
          "hip vs dense max / mean | kvpot vs hip max / mean | kvpot us | hip us |\n"
          "| --: | --- | --- | --- | --- | --: | --: | --: | --: | --: |")


def summary(results: dict) -> str:
    replaced = "\n".join(f"- `{name}`: {why}" for name, why in results["replaced_modules"].items())
    rows = "\n".join(_line(row) for row in results["rows"])
    failed = [row for row in results["rows"] if "error" in row]
    errors = "" if not failed else (f"\n\n{len(failed)} of {len(results['rows'])} rows raised (the run went on):\n\n"
                                    + "\n".join(f"- {row['length']} {row['case']} {row['layer']} {row['phase']}"
                                                 f"{' refresh ' + row['mask_refresh'] if 'mask_refresh' in row else ''}: "
                                                 f"`{row['error']}`" for row in failed))
    return (f"# kvpot InfiniteHiP beside hip-attn {results['hip_attn']} (triton {results['triton']})\n\n"
            f"{results['machine'].get('gpu') or results['machine']['device']}, commit "
            f"{results['machine'].get('git_commit')}\n\n{HEADER}\n{rows}{errors}\n\nLoaded without (placeholders "
            f"raise if called):\n\n{replaced}\n")


def _show(row: dict, progress: bool) -> None:
    if progress:
        print(_line(row), flush=True)
