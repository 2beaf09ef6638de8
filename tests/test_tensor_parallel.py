"""Tensor parallelism through transformers' TP plan, started the way users start it: `torchrun`.

One torchrun launch (two processes, gloo on the CPU) loads a tiny float32 Llama saved to disk with
`load_pretrained(tp_size=2)`, so transformers shards it itself, runs every method one sequence at a time and a
few through the batched scheduler (`tests/tensor_parallel_worker.py`), and writes each rank's tokens; here the
same runs in one process must give the same tokens on both ranks, sampled ones included. The methods whose
selection spans KV heads or layers (TOVA, CItruS layer-wise, InfiniPot share=layer/model, D2O's budgets,
InfLLM's lookups) gather every rank's scores; the others need nothing. CPU runtime: one launch, ~1-2 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tensor_parallel_worker as worker
from kvpot.errors import KvpotError
from kvpot.models import load_pretrained
from kvpot.models.parallel import check_heads, check_world

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT = 900


def save_tiny(path: Path) -> Path:
    """A random 4-layer Llama with 8 query and 4 KV heads (2 of each kind per rank at TP=2), the reference
    byte tokenizer, saved so `from_pretrained` (and its TP plan) reads it."""
    from kvpot.models.reference.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    # transformers (5.17) shards the head by vocabulary ("colwise_gather_output") and needs it divisible by the
    # ranks; the tests compare token ids, never text, so ids past the tokenizer's 259 are harmless
    vocab = -(-len(tokenizer) // WORLD) * WORLD
    config = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=256, vocab_size=vocab, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def torchrun(args: list[str], nproc: int, gpus: bool = False, timeout: int = TIMEOUT):
    """`torchrun --standalone --nproc-per-node nproc ARGS`; on the CPU (gloo) unless `gpus` (NCCL)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # transformers picks the accelerator it sees: none, so gloo on the CPU
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-tp"))


@pytest.fixture(scope="module")
def ranks(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-out")
    done = torchrun([str(ROOT / "tests" / "tensor_parallel_worker.py"), str(tiny_model), str(out)], WORLD)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def alone(tiny_model):
    model, tokenizer = load_pretrained(tiny_model, device="cpu")
    threads = torch.get_num_threads()
    try:
        return worker.run(model, tokenizer)
    finally:
        torch.set_num_threads(threads)


def test_tensor_parallel_ranks_hold_their_own_kv_heads(ranks, alone):
    assert alone["kv_heads"] == [4]
    assert [r["kv_heads"] for r in ranks] == [[2], [2]]  # the cache sized from the heads the rank sees
    assert [r["world"] for r in ranks] == [WORLD, WORLD]


@pytest.mark.parametrize("name", sorted(worker.cases()))
def test_tensor_parallel_every_method_gives_the_one_process_tokens(ranks, alone, name):
    expected = alone["one"][name]
    if name == "infinitehip-shared":  # its search takes the max over every head inside a kernel: refused
        assert "error" not in expected
        for rank in ranks:
            assert "selection=head" in rank["one"][name]["error"]
        return
    assert "error" not in expected, expected
    for rank in ranks:
        got = rank["one"][name]
        assert "error" not in got, got
        assert got["tokens"] == expected["tokens"]
        assert got["sampled"] == expected["sampled"]  # seeded sampling: rank 0's pick, the one-process pick
        assert got["max_kv_entries"] == expected["max_kv_entries"]


@pytest.mark.parametrize("name", worker.BATCHED)
def test_tensor_parallel_scheduler_gives_the_tokens_it_gives_alone(ranks, alone, name):
    expected = alone["batched"][name]
    assert expected["cancelled"] == "cancelled"
    for rank in ranks:
        assert rank["batched"][name] == expected  # the same tokens, slots and step count on every rank


@pytest.mark.parametrize("name", worker.CORE)
def test_tensor_parallel_one_sequence_through_the_core_gives_the_one_process_tokens(ranks, alone, name):
    """`Engine(runner="core")` under torchrun: each rank submits the request itself, the agreement matches them."""
    expected = alone["one"][name]["tokens"]
    assert alone["core"][name] == {"tokens": expected, "runner": "core"}
    for rank in ranks:
        assert rank["core"][name] == {"tokens": expected, "runner": "core"}


def test_tensor_parallel_scheduler_orders_prompts_by_rank_0s_clock(ranks, alone):
    """Shortest first with a patience: every rank reads the prompts in rank 0's order, though the other ranks' own
    clocks run fast enough to put every prompt past its patience (`StepInputs.clock`)."""
    expected = alone["shortest_first"]
    assert "error" not in expected, expected
    assert expected["first_token_order"] == [2, 1, 0]  # the shortest prompt (the last submitted) answered first
    for rank in ranks:
        assert rank["shortest_first"] == expected


def test_tensor_parallel_matrix_vector_kernel_sees_each_rank_local_shard(ranks, alone):
    """The single-row mode (kvpot's matrix-vector kernel on a GPU) under transformers' TP forward: every
    projection reaches it as the rank's plain local shard (column-wise: half the rows, row-wise: half the
    columns), never as a DTensor, and the logits are one process's. The head (the last call) is half the
    vocabulary where transformers shards it (5.17 on), whole where it does not (5.13)."""
    whole = alone["routed"]
    assert whole["calls"] and all("DTensor" not in kinds for _, *kinds in whole["calls"])
    assert whole["top"] == whole["plain_top"]
    for rank in ranks:
        got = rank["routed"]
        assert len(got["calls"]) == len(whole["calls"])  # every projection and the head took the kernel's path
        for index, ((shape, *kinds), (full, *_)) in enumerate(zip(got["calls"], whole["calls"], strict=True)):
            assert "DTensor" not in kinds
            shards = [[full[0] // WORLD, full[1]], [full[0], full[1] // WORLD]]
            head = index == len(whole["calls"]) - 1
            assert shape in shards + ([full] if head else []), (index, shape, full)
        assert got["top"] == whole["top"]
        assert got["max_diff"] < 1e-4


def compare(ranks: list[dict], alone: dict) -> None:
    for name, expected in alone["one"].items():
        for rank in ranks:
            if name == "infinitehip-shared":
                assert "selection=head" in rank["one"][name]["error"]
            else:
                assert rank["one"][name] == expected, name
    for name, expected in alone["batched"].items():
        assert [rank["batched"][name] for rank in ranks] == [expected] * len(ranks), name
    for rank in ranks:  # the kernel's path on each rank's shard (kvpot's Triton kernel on a GPU)
        assert len(rank["routed"]["calls"]) == len(alone["routed"]["calls"])
        assert rank["routed"]["top"] == alone["routed"]["top"]


@pytest.mark.gpu
def test_tensor_parallel_on_two_gpus_captures_the_collectives(tiny_model, tmp_path):
    """NCCL on two GPUs: decoding steps are CUDA graphs whose captured body holds the collectives (the token's
    broadcast, TOVA's gathered heads in its steady steps, InfLLM's all-reduce), batched steps too."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    done = torchrun([str(ROOT / "tests" / "tensor_parallel_worker.py"), str(tiny_model), str(tmp_path)], 2, gpus=True)
    assert done.returncode == 0, done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    model, tokenizer = load_pretrained(tiny_model, device="cuda", dtype=torch.float32)
    compare(ranks, worker.run(model, tokenizer))


def test_tensor_parallel_refuses_a_size_that_is_not_the_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(KvpotError, match="torchrun --nproc-per-node 2"):
        check_world(2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(KvpotError, match="tp_size=4"):
        check_world(2)


def test_tensor_parallel_refuses_heads_that_do_not_divide():
    config = LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=6)
    check_heads(config, 3)
    with pytest.raises(KvpotError, match="allows tp_size 1, 2, 3, 6"):
        check_heads(config, 4)


def test_tensor_parallel_load_refuses_before_reading_weights(tiny_model, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(KvpotError, match="WORLD_SIZE"):
        load_pretrained(tiny_model, tp_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KvpotError, match="device_map"):
        load_pretrained(tiny_model, device=None, device_map="auto", tp_size=2)
