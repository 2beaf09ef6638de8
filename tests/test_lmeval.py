"""The `kvpot` model of lm-evaluation-harness, on the reference model, through the harness itself.

The harness reads a task defined in tests/fixtures/lmeval/*.yaml over a local jsonl file (no
download): generate_until, multiple_choice (loglikelihood) and loglikelihood_rolling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

lm_eval = pytest.importorskip("lm_eval", reason='lm-eval is an optional extra: pip install "kvpot[lmeval]"')

from lm_eval.api.instance import Instance  # noqa: E402

from kvpot.errors import KvpotError  # noqa: E402
from kvpot.integrations.lmeval import KvpotLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "fixtures" / "lmeval"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def full_lm():
    return KvpotLM(method="full", device="cpu")


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_the_harness_finds_kvpot_and_still_its_own_models():
    from lm_eval.api.registry import get_model

    assert get_model("kvpot") is KvpotLM
    assert get_model("hf").__name__ == "HFLM"  # registering kvpot first must not hide lm-eval's models


def test_loglikelihood_with_full_is_the_models_own(full_lm):
    context, continuation = "The grass is green. The sky is", " blue."
    (logprob, greedy), = full_lm.loglikelihood([request("loglikelihood", context, continuation)])
    context_ids, target = full_lm._pair(context, continuation)
    assert full_lm.tokenizer.decode(target) == " blue."
    ids = torch.tensor([context_ids + target])
    plain = AutoModelForCausalLM.from_pretrained(full_lm.pretrained, attn_implementation="sdpa").eval()
    with torch.no_grad():  # the model's own forward, no kvpot in it
        logits = plain(ids).logits.double().log_softmax(-1)[0]
    expected = sum(float(logits[len(context_ids) - 1 + i, t]) for i, t in enumerate(target))
    assert logprob == pytest.approx(expected, abs=1e-3)
    best = [int(logits[len(context_ids) - 1 + i].argmax()) for i in range(len(target))]
    assert greedy == (best == target)


def test_trailing_spaces_move_to_the_continuation(full_lm):
    context_ids, target = full_lm._pair("Answer: ", "yes")
    assert full_lm.tokenizer.decode(target) == " yes"
    assert full_lm.tokenizer.decode(context_ids, skip_special_tokens=True) == "Answer:"


def test_an_empty_context_is_lm_evals_prefix_token(full_lm):
    context_ids, target = full_lm._pair("", "hello")
    assert context_ids == full_lm.start and full_lm.start == [full_lm.tokenizer.bos_token_id]
    assert full_lm.tokenizer.decode(target) == "hello"


def test_generate_until_stops_at_the_stop_strings(full_lm):
    (free,) = full_lm.generate_until([request("generate_until", "The grass is green. The", {"max_gen_toks": 12})])
    assert free  # the byte model writes something
    stop = free[len(free) // 2]
    (cut,) = full_lm.generate_until([request("generate_until", "The grass is green. The",
                                             {"max_gen_toks": 12, "until": [stop]})])
    assert cut == free.split(stop)[0]


def test_method_arguments_split_by_lm_evals_commas_reach_the_method():
    lm = KvpotLM.create_from_arg_string("method=streaming:sinks=4,window=60,greedy_check=false",
                                        {"device": "cpu", "batch_size": 1})
    assert lm.engine.method.config()["window"] == 60 and lm.engine.method.config()["sinks"] == 4
    assert lm.greedy_check is False
    with pytest.raises(KvpotError, match="unknown method"):
        KvpotLM(method="nope", device="cpu")


@pytest.mark.slow
def test_simple_evaluate_runs_a_local_task_with_a_method(monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the YAML names its jsonl relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = "method=streaming:sinks=4,window=60"
    out = lm_eval.simple_evaluate(
        model="kvpot", model_args=args, device="cpu", limit=1, log_samples=True,
        tasks=["kvpot_fixture_generate", "kvpot_fixture_choice", "kvpot_fixture_rolling"],
        task_manager=TaskManager(include_path=str(TASKS)),
    )
    results = out["results"]
    assert results["kvpot_fixture_choice"]["acc,none"] in (0.0, 1.0)
    assert results["kvpot_fixture_generate"]["exact_match,none"] in (0.0, 1.0)
    assert results["kvpot_fixture_rolling"]["word_perplexity,none"] > 1
    # The harness's numbers are the model's: score the same requests directly.
    lm = KvpotLM.create_from_arg_string(args, {"device": "cpu"})
    choice = out["samples"]["kvpot_fixture_choice"][0]
    arguments = choice["arguments"]  # (context, continuation) per choice; a dict once serialised
    pairs = [tuple(a.values()) for a in arguments.values()] if isinstance(arguments, dict) else arguments
    expected = lm.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    got = [r[0] for r in choice["resps"]]
    assert [g[0] for g in got] == pytest.approx([e[0] for e in expected], abs=1e-4)


def test_generate_until_in_batches_gives_the_one_at_a_time_texts():
    prompts = ["The grass is green. The", "Once upon a time", "Answer: the sky is", "x"]
    requests = [request("generate_until", text, {"max_gen_toks": 10, "until": ["\n\n"]}) for text in prompts]
    one = KvpotLM(method="streaming:sinks=4,window=60", device="cpu", batch_size=1).generate_until(requests)
    lm = KvpotLM(method="streaming:sinks=4,window=60", device="cpu", batch_size=3)
    assert lm.batch_size == 3
    assert lm.generate_until(requests) == one
    assert KvpotLM(method="full", device="cpu", batch_size="auto:4", max_batch_size=8).batch_size == 8
    invariant = KvpotLM.create_from_arg_string("method=streaming:sinks=4,window=60,batch_invariant=true",
                                               {"device": "cpu", "batch_size": 3})
    assert invariant.engine.batch_invariant and invariant.generate_until(requests) == one
    with pytest.raises(KvpotError, match="batch_invariant must be true or false"):
        KvpotLM(method="full", device="cpu", batch_invariant="maybe")
