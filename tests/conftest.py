"""Tiny models built from configs (never downloaded), one per supported architecture."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def llama3_rope() -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }


# arch -> (model class, its config made with COMMON, the arch's own settings and the caller's overrides): overrides
# go to the constructor, so what a config derives at init (head_dim from hidden_size and the heads, in the
# transformers versions that fix it there) follows them
ARCH_CONFIGS = {
    "llama3": lambda **o: (LlamaForCausalLM, LlamaConfig(**{**COMMON, "rope_parameters": llama3_rope(), **o})),
    "mistral": lambda **o: (MistralForCausalLM, MistralConfig(**{**COMMON, "sliding_window": None, **o})),
    "qwen2": lambda **o: (Qwen2ForCausalLM, Qwen2Config(**{**COMMON, **o})),
    "qwen3": lambda **o: (Qwen3ForCausalLM, Qwen3Config(**{**COMMON, "head_dim": 16, **o})),
}

ROPE_VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": llama3_rope(),
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
}


def build(arch: str, seed: int = 0, **overrides):
    """A float32 tiny model of `arch`, seeded, eval mode, with sdpa attention for references."""
    torch.manual_seed(seed)
    model_class, config = ARCH_CONFIGS[arch](**overrides)
    model = model_class(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def build_llama(rope: dict | None = None, seed: int = 0, **config_overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**COMMON, **config_overrides}, rope_parameters=rope or ROPE_VARIANTS["default"])
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(params=sorted(ARCH_CONFIGS))
def arch(request) -> str:
    return request.param


def reference_greedy(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """transformers' own greedy generation (sdpa attention), the exactness reference."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(ids.view(1, -1), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.numel() :].tolist()


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_kernels():
    """The `pytestmark` of a Triton kernel test module: CUDA, or Triton's interpreter on a CPU."""
    from kvpot import kernels

    return pytest.mark.skipif(
        not kernels.available(KERNEL_DEVICE),
        reason="needs CUDA and Triton (or, on CPU, Triton installed and TRITON_INTERPRET=1)",
    )


def interpreter_runtime_loops() -> None:
    """Triton 3.6's interpreter turns a loop bound that is a runtime int into a 1-element array and
    calls int() on it, which numpy >= 2 refuses; read its one element instead (tests only: compiled
    kernels never take this path). Does nothing unless the kernels run interpreted."""
    from kvpot import kernels

    if not (kernels.interpreting() and kernels.available("cpu")):
        return
    from triton.runtime import interpreter

    _interpreter_bf16_to_nearest(interpreter)
    _interpreter_vectorized_reduce(interpreter)
    original = interpreter._patch_lang_tensor
    if getattr(original, "kvpot_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kvpot_fixed = True
    interpreter._patch_lang_tensor = patched


def _interpreter_vectorized_reduce(interpreter) -> None:
    """Triton 3.6's interpreter runs a reduction with a kernel's own combine function (`tl.reduce` over a
    tuple: `kernels.roco`'s packed counts) one element at a time in Python, seconds per reduction over a
    tile of thousands. Reduce in log2(n) vectorized rounds instead, each combining adjacent pairs: the
    order is kept, so any associative combine function gives what the element loop gives (one that cannot
    take whole arrays, e.g. Python's `or` on tensors, raises and takes the element loop)."""
    import numpy as np

    ops = interpreter.ReduceOps
    original = ops.generic_reduce
    if getattr(original, "kvpot_fixed", False):
        return

    def generic_reduce(self, input):
        try:
            return vectorized(self, input)
        except Exception:  # noqa: BLE001 - any case the vectorized path does not cover falls back
            return original(self, input)

    def vectorized(self, input):
        axis = 0 if self.axis is None else self.axis
        data = [t.handle.data.reshape(-1) if self.axis is None else t.handle.data for t in input]
        length = data[0].shape[axis]
        if length < 1 or length & (length - 1):
            return original(self, input)
        dtypes = [t.dtype for t in input]
        while data[0].shape[axis] > 1:
            halves = [self.to_tensor(np.take(d, np.arange(first, d.shape[axis], 2), axis=axis), dt)
                      for first in (0, 1) for d, dt in zip(data, dtypes)]
            out = self.combine_fn.fn(*halves)
            out = out if isinstance(out, tuple) else (out,)
            if not all(isinstance(o, interpreter.tl.core.tensor) for o in out):
                return original(self, input)
            data = [np.broadcast_to(o.handle.data, halves[0].handle.data.shape) for o in out]
        ret = []
        for d, dt in zip(data, dtypes):
            if self.axis is None:
                d = d.reshape(-1)[0]
                d = np.reshape(d, (1,) * len(input[0].shape)) if self.keep_dims else d.item()
            elif not self.keep_dims:
                d = np.squeeze(d, axis=axis)
            ret.append(self.to_tensor(d, dt))
        return ret

    generic_reduce.kvpot_fixed = True
    ops.generic_reduce = generic_reduce


def _interpreter_bf16_to_nearest(interpreter) -> None:
    """Triton 3.6's interpreter casts float32 to bfloat16 by dropping the low bits (and its "rtne" adds the
    cut-off bit, carrying wrongly); compiled kernels round to nearest even, as PyTorch does. Cast as they do."""
    import numpy as np
    from triton import language as tl

    original = interpreter._convert_float
    if getattr(original, "kvpot_fixed", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ:
            wide = torch.from_numpy(np.array(input, dtype=np.float32).reshape(-1))
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(np.shape(input))
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert.kvpot_fixed = True
    interpreter._convert_float = convert


def skip_interpreted_bf16(dtype: torch.dtype) -> None:
    from kvpot import kernels

    if dtype == torch.bfloat16 and kernels.interpreting():
        pytest.skip("Triton 3.6's interpreter multiplies the raw bits of bf16 dot operands; runs on CUDA")


# The files that take longest, in seconds of one CPU core (1 intra-op thread, as each of xdist's 2 workers runs them
# on 2 cores; measured here): `-n auto --dist loadfile` gives each worker a whole file, and xdist by
# default hands out the files with the most tests first, which left the slowest (a few tests each: SmolLM2, the
# demo, the reference model) to run last, where one worker could be busy with a 2-3 minute file while the other
# had nothing left. Under xdist they go first, longest first (the rest still by their number of tests), and the
# short files fill in beside them. A file missing here only runs later; nothing is skipped.
SLOWEST_FILES = {
    "test_smollm2.py": 150, "test_batch.py": 146, "test_packed.py": 127, "test_serve.py": 113, "test_demo.py": 90,
    "test_compile_step.py": 84, "test_bench.py": 72, "test_shared_document.py": 68, "test_tensor_parallel.py": 57,
    "test_reference_model.py": 55, "test_bench_serve.py": 51, "test_replace.py": 48, "test_bench_load.py": 43,
    "test_eval_resume.py": 40, "test_tensor_parallel_serve.py": 32, "test_eval_kvpress.py": 32,
}


def pytest_configure(config):
    """Under `--dist loadfile` (or loadscope) xdist hands out files in the collection's order, which
    `pytest_collection_modifyitems` sets: longest first (its own reordering, by test count, is off)."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope") and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _slowest_files_first(items) -> None:
    """In an xdist worker: the files of `SLOWEST_FILES` first, longest first, then the others by their number of
    tests, most first (xdist's own order); each file's tests keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    items.sort(key=lambda item: (-SLOWEST_FILES.get(item.path.name, 0), -counts[item.path.name], str(item.path)))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skip them (with the reason) where there is none. Under xdist, the
    slowest files first (`_slowest_files_first`)."""
    _slowest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The machine's own intra-op thread count, before any test changes it, shared among xdist's workers (for
# `all_threads`): under `-n auto` on 2 cores each of the 2 workers takes 1. Two threads in each of two busy workers
# (4 on 2 cores) stall each other: in CI the reference model's accuracy bars took 80-92 s and 53-81 s (18 s alone),
# SmolLM2's 16K read 193-216 s (80 s alone with two threads, about 100 s with one beside another worker).
DEFAULT_THREADS = max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, for every test (autouse; tests that name it keep saying so): on a shared 2-core
    machine, two threads can run a tiny model 100x slower. Measured here: with one core busy elsewhere,
    test_citrus's 64x-budget bound took 9-21 s per case with two threads and 2-3 s with one; in a full run
    during another process's load, tests that did not ask for one thread (test_capabilities, test_citrus,
    test_bounds, test_d2o) took 20-90 s each instead of about 1 s. A test of a real, compute-bound model
    asks for `all_threads` instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def all_threads(one_thread):
    """Every intra-op thread the machine gives by default (this xdist worker's share of them: `DEFAULT_THREADS`),
    for a real model's long, compute-bound forwards, where two threads on idle cores pay: SmolLM2-135M reading 16K
    tokens took 52 s with two and 96 s with one; the reference model's 30-sample accuracy bars 13-15 s with two and
    20-23 s with one."""
    torch.set_num_threads(DEFAULT_THREADS)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama (GQA 4:2, window 2048) with the reference byte tokenizer, saved to disk."""
    from kvpot.models.reference.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=len(tokenizer), max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama-reference-tokenizer")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def rope_table(length: int, d: int, dtype: torch.dtype, device=KERNEL_DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """A default-RoPE cos/sin table [length, d] (rotate_half layout) for the decode attention tests."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


# Batched decode attention cases: (name, query heads, kv heads, head dim, capacity, each slot's live
# length, each batch row's slot). Slots no row names are poisoned whole.
BATCH_SHAPES = [
    ("b1-s1-gqa4-d128", 8, 2, 128, 160, [97], [0]),
    ("b3-s5-gqa1-d64", 8, 8, 64, 130, [130, 7, 1, 77, 40], [2, 0, 3]),  # lengths 1, full and ragged
    ("shared-slot-gqa8-d64", 16, 2, 64, 200, [50, 173, 3], [1, 0, 1, 2]),  # rows 0 and 2 read slot 1
    ("empty-slot-gqa4-d128", 8, 2, 128, 100, [0, 64, 99], [1, 0, 2]),  # row 1's slot has no live entry
    ("padding-rows-gqa8-d128", 16, 2, 128, 96, [31, 0], [0, 1, 1, 1]),  # padding rows on an empty scratch slot
]


def make_batch_inputs(shape, dtype, seed, rope=True, positions_dtype=torch.int64, device=KERNEL_DEVICE):
    """Fresh inputs for a `BATCH_SHAPES` case: (query, keys, values, rows, lengths, RoPE arguments).

    keys/values are strided views of a wider pool buffer; entries past each slot's length, and every
    entry of a slot no row names, are poisoned (NaN keys/values, positions far outside the table)."""
    _, heads, kv, d, capacity, lengths, rows = shape
    slots, batch = len(lengths), len(rows)
    gen = torch.Generator(device=device).manual_seed(seed)
    query = torch.randn(batch, heads, d, generator=gen, device=device).to(dtype)
    buffer = torch.randn(2, slots, kv, capacity + 5, d, generator=gen, device=device).to(dtype)
    keys, values = buffer[0, :, :, :capacity], buffer[1, :, :, :capacity]
    table = 2 * capacity + 16
    # distinct positions per KV head with gaps, in random order (evictions leave the cache unsorted)
    positions = torch.stack([torch.randperm(table - 16, generator=gen, device=device)[:capacity]
                             for _ in range(slots * kv)]).view(slots, kv, capacity)
    for slot, length in enumerate(lengths):
        dead = slice(length if slot in rows else 0, None)
        keys[slot, :, dead] = float("nan")
        values[slot, :, dead] = float("nan")
        positions[slot, :, dead] = 10**9  # far outside the table: a masked-off load only
    query_positions = table - 1 - torch.randint(0, 16, (slots, kv), generator=gen, device=device)
    extra = {}
    if rope:
        cos, sin = rope_table(table, d, dtype, device)
        extra = dict(cos=cos, sin=sin, key_positions=positions.to(positions_dtype), query_positions=query_positions)
    return (query, keys, values, torch.tensor(rows, device=device), torch.tensor(lengths, device=device), extra)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`kvpot ARGV...` in-process: (exit code, stdout, stderr)."""
    from kvpot.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_png(path) -> None:
    """A real, non-trivial PNG file."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 1024, path


@contextlib.contextmanager
def compiled_graphs(monkeypatch):
    """`torch.compile` with a backend that keeps every graph it is handed and runs it as traced: yields
    (graphs, graph breaks); the breaks dict fills when the block ends. Dynamo is reset before and after."""
    from torch._dynamo.utils import counters

    graphs, breaks = [], {}

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    try:
        yield graphs, breaks
        breaks.update(counters["graph_break"])
    finally:
        torch._dynamo.reset()


def graph_targets(gm) -> list:
    """The functions a traced graph calls, in order."""
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]
