"""D2O Fig. 4 on the reference model: per-layer attention variance F_v and the budgets it yields.

Run from the repository root (CPU, a few seconds):
    python benchmarks/d2o/variance_profile.py --out records/d2o/variance-profile
It reads one 1,900-token passkey prompt (varied haystack) with D2O at ratio 0.2, then saves the
per-layer normalised variances and budgets as JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import kvpot  # noqa: E402
from kvpot.methods.d2o import BUDGETS, VARIANCE  # noqa: E402
from kvpot.tasks import make_sample  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--length", type=int, default=1900)
    parser.add_argument("--ratio", type=float, default=0.2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = kvpot.Engine.from_pretrained(str(kvpot.REFERENCE_MODEL), method=kvpot.D2O(ratio=args.ratio))
    tok = engine.tokenizer
    sample = make_sample("passkey", tok, args.length, depth=0.5, seed=0, haystack="varied")
    state = engine.prefill_ids([tok.bos_token_id, *sample.context_ids], sample.question_ids)
    variance = state.cache.method_state[VARIANCE].tolist()
    budgets = state.cache.method_state[BUDGETS]
    prompt = state.stats.context_tokens + state.stats.question_tokens
    result = {"prompt_tokens": prompt, "ratio": args.ratio, "normalised_variance": variance, "budgets": budgets,
              "budget_total": sum(budgets), "uniform_budget": args.ratio * prompt,
              "note": "variances are min-max normalised over all (layer, KV head) pairs, then averaged per layer"}
    (args.out / "profile.json").write_text(json.dumps(result, indent=2))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    layers = range(len(variance))
    left.bar(layers, variance, color="tab:blue")
    left.set(title="attention variance per layer (F_v, normalised)", xlabel="layer", ylabel="F_v")
    right.bar(layers, budgets, color="tab:green")
    right.axhline(args.ratio * prompt, color="grey", linestyle="--", label=f"uniform ({args.ratio:g} x prompt)")
    right.set(title=f"D2O budgets S_l (prompt {prompt} tokens)", xlabel="layer", ylabel="KV entries")
    right.legend()
    fig.tight_layout()
    fig.savefig(args.out / "profile.png", dpi=120)
    print(json.dumps({k: result[k] for k in ("prompt_tokens", "normalised_variance", "budgets")}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
