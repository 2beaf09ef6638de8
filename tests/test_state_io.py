"""State.save / State.load: a saved prefill answers exactly as the live one, and bad files are refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_llama

from kvpot import (CItruS, D2O, H2O, TOVA, CaM, Engine, Full, InfiniPot, InfiniteHiP, KvpotError, SelfExtend, SirLLM,
                   SnapKV, State, StreamingLLM)
from kvpot import InfLLM, PyramidKV, RoCo, Scissorhands
from kvpot.errors import Cancelled

METHODS = {
    "full": lambda: Full(),
    "streaming": lambda: StreamingLLM(sinks=4, window=60),
    "infinipot": lambda: InfiniPot(pot_size=64, compress_size=32, catalyst=None),
    "h2o": lambda: H2O(heavy=24, recent=24),
    "tova": lambda: TOVA(budget=48),
    "snapkv": lambda: SnapKV(budget=48, window=8),
    "d2o": lambda: D2O(budget=48, merge=True),
    "pyramidkv": lambda: PyramidKV(budget=48, window=8, beta=2),
    "scissorhands": lambda: Scissorhands(budget=48, drop=16, history=12, chunk_size=32),
    "roco": lambda: RoCo(budget=48, chunk_size=32),
    "sirllm": lambda: SirLLM(pot_size=64, decay=0.9),
    "cam": lambda: CaM(start=8, recent=40, chunk_size=16, merge_budget=8),
    "citrus": lambda: CItruS(keep=48, chunk_size=32, cache="individual", instruction="What is the key?"),
    "selfextend": lambda: SelfExtend(group_size=4, window=16, chunk_size=64),
    # InfLLM's units are rebuilt from the saved representative scores
    "infllm": lambda: InfLLM(kernels="torch", initial=4, window=32, block_size=8, representatives=2, topk=3,
                             lookup=16, chunk_size=32),
    # InfiniteHiP's sparse-attention runtime is rebuilt by Method.begin on resume, so it is not saved
    "infinitehip": lambda: InfiniteHiP(kernels="torch", chunks=(32, 8, 4), keep=(64, 32, 16), sink=4, window=16,
                                       early_keep=32, query_block=16),
}


def _engine(method, seed: int = 0) -> Engine:
    """A random tiny Llama with the reference byte tokenizer (CItruS tokenizes its instruction)."""
    from kvpot.models.reference.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    return Engine(build_llama(seed=seed, vocab_size=len(tokenizer)), tokenizer, method=method)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_saved_state_generates_the_same_tokens(name, tmp_path, one_thread):
    engine = _engine(METHODS[name]())
    context, question = _ids(200), _ids(6, seed=1)
    state = engine.prefill_ids(context)
    expected = engine.generate_ids(question_ids=question, state=state, max_new_tokens=8, ignore_eos=True)
    path = tmp_path / "state.safetensors"
    size = state.save(path)
    assert size == path.stat().st_size > 0
    loaded = State.load(path, engine)
    assert loaded.next_position == state.next_position == 200
    assert loaded.stats.context_tokens == 200 and loaded.nbytes == state.nbytes
    for a, b in zip(state.cache.layers, loaded.cache.layers):
        assert a.n == b.n and torch.equal(a.keys[:, :, : a.n], b.keys[:, :, : b.n])
        assert sorted(a.scores) == sorted(b.scores)
    again = engine.generate_ids(question_ids=question, state=loaded, max_new_tokens=8, ignore_eos=True)
    assert again.token_ids == expected.token_ids
    # the loaded state is not consumed either
    assert engine.generate_ids(question_ids=question, state=loaded, max_new_tokens=8,
                               ignore_eos=True).token_ids == expected.token_ids


def test_state_files_refuse_other_models_methods_and_damage(tmp_path, one_thread):
    engine = _engine(StreamingLLM(sinks=4, window=60))
    path = tmp_path / "s.safetensors"
    engine.prefill_ids(_ids(100)).save(path)
    with pytest.raises(KvpotError, match="another model"):
        State.load(path, _engine(StreamingLLM(sinks=4, window=60), seed=1))
    with pytest.raises(KvpotError, match="prefilled with"):
        State.load(path, Engine(engine.model, engine.tokenizer, method=StreamingLLM(sinks=4, window=30)))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the last tensor's bytes
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    with pytest.raises(KvpotError, match="checksum"):
        State.load(damaged, engine)
    (tmp_path / "junk.safetensors").write_bytes(b"not a state")
    with pytest.raises(KvpotError, match="not a kvpot state"):
        State.load(tmp_path / "junk.safetensors", engine)
    with pytest.raises(KvpotError, match="no state file"):
        State.load(tmp_path / "missing.safetensors", engine)
    # a future format version is refused with the version named
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["kvpot"])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    meta["version"] = 99
    save_file(tensors, str(tmp_path / "v99.safetensors"), metadata={"kvpot": json.dumps(meta)})
    with pytest.raises(KvpotError, match="version 99"):
        State.load(tmp_path / "v99.safetensors", engine)


def test_should_stop_cancels_prefill_and_decoding(one_thread):
    engine = _engine(StreamingLLM(sinks=4, window=28, chunk_size=20))
    calls = []

    def stop_after(n):
        def check():
            calls.append(1)
            return len(calls) > n
        return check

    with pytest.raises(Cancelled):
        engine.prefill_ids(_ids(200), should_stop=stop_after(2))  # ten chunks: stops before the third
    assert len(calls) == 3
    calls.clear()
    state = engine.prefill_ids(_ids(20))
    seen = []
    with pytest.raises(Cancelled):
        engine.generate_ids(question_ids=_ids(3), state=state, max_new_tokens=50, ignore_eos=True,
                            on_token=seen.append, should_stop=stop_after(4))
    assert len(seen) == 4  # one check before the question's forward, then one after each token
