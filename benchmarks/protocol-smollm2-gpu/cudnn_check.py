"""Issue 32 on the GPU: one kvpress answer timed with SDPA's default backends and with cuDNN's attention off.

Runs in kvpress' environment (PYTHONPATH = the kvpress folder, then kvpot's src/), on ruler/'s first cases
(kvpress-cases.jsonl.gz), through kvpot's protocol (`kvpot.bench.kvpress_runner.answer`), each setting in a
fresh process (cuDNN's plan cache is per process). Prints one JSON line per (setting, press, case): prefill
and decode seconds, the kept entries of the first and last layer, and the tokens (the same with either
backend unless bf16 rounding flips a greedy choice).

    PYTHONPATH=/tmp/kvpress-site:$PWD/src python benchmarks/protocol-smollm2-gpu/cudnn_check.py MODEL_DIR [CASES]
"""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

RECORDS = Path(__file__).resolve().parents[2] / "records" / "protocol-smollm2-gpu"  # the recorded runs
CASES = RECORDS / "ruler" / "kvpress-cases.jsonl.gz"
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")  # cpu: only to try the script (no cuDNN there)


def one(model_dir: str, cudnn: str, press_name: str, count: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import kvpress
    from kvpot.bench.kvpress_runner import answer, attention_backends

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    model.set_attn_implementation("sdpa")
    if cudnn == "off":
        attention_backends(DEVICE)
    with gzip.open(CASES, "rt") as handle:
        cases = [json.loads(line) for line, _ in zip(handle, range(count))]
    for case in cases:
        press = getattr(kvpress, press_name)(compression_ratio=0.5)
        with torch.no_grad():
            tokens, kept, seconds = answer(model, press, torch.tensor(case["context_ids"], device=DEVICE),
                                           torch.tensor(case["question_ids"], device=DEVICE),
                                           case["max_new_tokens"], set(case["eos_ids"]))
        print(json.dumps({"cudnn": cudnn, "press": press_name, "case": case["case"],
                          "context": len(case["context_ids"]), **{k: round(v, 2) for k, v in seconds.items()},
                          "kept": [kept[0], kept[-1]], "tokens": tokens}), flush=True)


def main() -> None:
    if sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    count = sys.argv[2] if len(sys.argv) > 2 else "4"  # cases 0-2 at 4K, case 3 at 16K
    for cudnn in ("default", "off"):
        for press in ("PyramidKVPress", "SnapKVPress"):
            subprocess.run([sys.executable, __file__, "--one", sys.argv[1], cudnn, press, count], check=False)


if __name__ == "__main__":
    main()
