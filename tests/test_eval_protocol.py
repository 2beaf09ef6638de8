"""The evaluation protocol of issue 32: Wilson intervals on known values, the chat dimension of a cell,
RULER's templates and chat flags, and rankings claimed only where intervals separate."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run
from kvpot.errors import KvpotError
from kvpot.eval.stats import accuracy_stats, separated, stats_of, wilson_interval

CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Published 95% Wilson score intervals (e.g. Newcombe 1998, Table I; Agresti & Coull 1998), 4 decimals.
@pytest.mark.parametrize("correct,total,low,high", [
    (0, 10, 0.0, 0.2775), (1, 10, 0.0179, 0.4042), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0),
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_wilson_interval_on_known_values(correct, total, low, high):
    got = wilson_interval(correct, total)
    assert got == pytest.approx((low, high), abs=5e-5)
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_separation_needs_disjoint_intervals():
    assert separated(stats_of(35, 35), stats_of(20, 35))  # 0.90-1.00 against 0.41-0.72
    assert not separated(stats_of(30, 30), stats_of(28, 30))  # 0.89-1.00 against 0.79-0.98
    assert not separated(stats_of(1, 1), stats_of(0, 1))  # one sample each proves nothing
    assert not separated(stats_of(3, 3), stats_of(0, 0))  # nothing ran: no claim


def test_accuracy_stats_split_by_template_and_chat():
    rows = [{"correct": c, "score": float(c), "template": t, "chat": h}
            for t, h, c in [(0, False, 1), (0, True, 0), (1, False, 1), (1, True, 1), (2, False, 0), (2, True, 0)]]
    stats = accuracy_stats(rows)
    assert (stats["correct"], stats["total"]) == (3, 6)
    assert stats["by_template"] == {"0": 0.5, "1": 1.0, "2": 0.0} and stats["template_spread"] == [0.0, 1.0]
    assert stats["by_chat"] == {"plain": pytest.approx(2 / 3), "chat": pytest.approx(1 / 3)}
    assert stats["chat_spread"] == [pytest.approx(1 / 3), pytest.approx(2 / 3)]
    old = accuracy_stats([{"correct": True, "score": 1.0}])  # rows written before templates and chat
    assert old["by_template"] == {"0": 1.0} and old["by_chat"] == {"plain": 1.0}
    assert old["template_spread"] is None and old["chat_spread"] is None


@pytest.fixture
def chat_dir(tiny_dir, tmp_path):
    """The tiny model with a chat template added to its tokenizer."""
    path = tmp_path / "tiny-chat"
    shutil.copytree(tiny_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_wrapper_puts_the_sample_inside_one_user_turn(chat_dir):
    from transformers import AutoTokenizer

    from kvpot.eval.prompting import Wrapper, resolve_chat

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    wrap = Wrapper(tokenizer, [tokenizer.bos_token_id])
    context = tokenizer.encode("Some text.", add_special_tokens=False)
    question = tokenizer.encode("\nQ?", add_special_tokens=False)
    plain = wrap(context, question, False)
    assert plain == ([tokenizer.bos_token_id] + context, question)
    chat_context, chat_question = wrap(context, question, True)
    text = tokenizer.decode(chat_context + chat_question)
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "Some text.\nQ?"}],
                                                 add_generation_prompt=True, tokenize=False)
    assert chat_context[-len(context):] == context and chat_question[:len(question)] == question
    assert resolve_chat("both", tokenizer) == [False, True]
    plain_tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    plain_tokenizer.chat_template = None
    assert resolve_chat("both", plain_tokenizer) == [False]
    with pytest.raises(KvpotError, match="no chat template"):
        resolve_chat("chat", plain_tokenizer)


def test_eval_reads_each_sample_plain_and_in_the_chat_template(capsys, chat_dir, tmp_path):
    out = tmp_path / "chat"
    code, stdout, _ = run(capsys, "eval", "passkey", "--method", "full", "--lengths", "300", "--depths", "0.5",
                          "--samples", "2", "--templates", "0", "--max-new-tokens", "2", "--model", str(chat_dir),
                          "--out", str(out))
    assert code == 0
    rows = read_rows(out / "results.jsonl")
    assert sorted((r["chat"], r["sample"]) for r in rows) == [(False, 0), (False, 1), (True, 0), (True, 1)]
    assert len({r["seed"] for r in rows}) == 4  # each chat flag reads its own samples
    plain_seeds = {r["sample"]: r["seed"] for r in rows if not r["chat"]}
    from kvpot.eval.config import sample_seed

    assert plain_seeds == {i: sample_seed(0, i, 300, 0.5) for i in (0, 1)}  # the seeds runs had before
    chat_tokens = {r["stats"]["context_tokens"] for r in rows if r["chat"]}
    assert chat_tokens and min(chat_tokens) > 301  # the template's head before the 300 tokens (plain: BOS + 300)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chat_flags"] == [False, True] and summary["config"]["chat"] == "both"
    cell = summary["intervals"]["full"]["300"]
    assert set(cell["by_chat"]) == {"plain", "chat"} and cell["total"] == 4
    assert "plain and inside the chat template" in (out / "summary.md").read_text()
    code, _, err = run(capsys, "eval", "passkey", "--method", "full", "--lengths", "300", "--depths", "0.5",
                       "--samples", "1", "--chat", "chat", "--out", str(tmp_path / "ref"))
    assert code == 2 and "no chat template" in err  # the reference model has none


def test_chat_option_is_for_tasks_and_ruler(tmp_path):
    from kvpot.eval.config import EvalConfig

    assert EvalConfig("passkey", ["full"], tmp_path / "o").chat == "both"
    assert EvalConfig("ruler", ["full"], tmp_path / "o", chat="plain").chat == "plain"
    with pytest.raises(KvpotError, match="follows its own rule"):
        EvalConfig("longbench", ["full"], tmp_path / "o", data_dir=str(tmp_path), chat="plain")
    with pytest.raises(KvpotError, match="--chat must be one of"):
        EvalConfig("niah", ["full"], tmp_path / "o", chat="yes")


def test_ruler_spreads_items_over_templates_and_chat_flags():
    from kvpot.models.reference.tokenizer import build_tokenizer
    from kvpot.tasks import ruler
    from kvpot.tasks.suites import load_items

    tokenizer = build_tokenizer()
    items = load_items("ruler", tokenizer=tokenizer, lengths=[2048], samples=1, seed=3,
                       tasks=["niah_single_3", "vt", "cwe", "fwe"], templates=[0, 1, 2], chats=[False, True])
    assert len(items) == 4 * 3 * 2
    assert len({i.extra["seed"] for i in items}) == len(items)
    old = load_items("ruler", tokenizer=tokenizer, lengths=[2048], samples=1, seed=3, tasks=["vt"])
    (same,) = [i for i in items if i.task == "vt" and i.extra["template"] == 0 and not i.chat]
    assert same.extra["seed"] == old[0].extra["seed"]  # template 0, plain: the seed runs had before
    for task in ("niah_single_3", "vt", "cwe", "fwe"):
        texts = {tokenizer.decode(sum(i.make_ids(), [])) for i in items if i.task == task and not i.chat}
        assert len(texts) == 3 and ruler.template_count(task) == 3
    uuid = next(i for i in items if i.task == "niah_single_3").answers[0]
    assert len(uuid) == 36 and uuid.count("-") == 4  # RULER's niah_single_3: UUID values
    assert ruler.template_count("qa_1") == 1


def test_eval_ruler_rows_carry_template_and_chat(capsys, chat_dir, tmp_path):
    out = tmp_path / "ruler"
    code, _, _ = run(capsys, "eval", "ruler", "--tasks", "niah_single_1", "--lengths", "300", "--samples", "1",
                     "--templates", "0,1", "--method", "full", "--max-new-tokens", "2", "--model", str(chat_dir),
                     "--out", str(out))
    assert code == 0
    rows = read_rows(out / "results.jsonl")
    assert sorted((r["template"], r["chat"]) for r in rows) == [(0, False), (0, True), (1, False), (1, True)]
    assert all(r["length"] > 301 for r in rows if r["chat"])  # the template's head and tail around the prompt
    summary = json.loads((out / "summary.json").read_text())
    cell = summary["intervals_by_group"]["full"]["300"]
    assert cell["total"] == 4 and set(cell["by_chat"]) == {"plain", "chat"} and set(cell["by_template"]) == {"0", "1"}
    assert "Whole answers by method and context length" in (out / "summary.md").read_text()
