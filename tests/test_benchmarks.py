"""LongBench, RULER and InfiniteBench: metrics, loaders over hand-written fixtures, and `kvpot eval` runs.

The fixtures under tests/fixtures/ are written for these tests in each benchmark's file format;
they hold no benchmark data.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from conftest import assert_png, run
from kvpot.errors import KvpotError
from kvpot.models.reference.tokenizer import build_tokenizer
from kvpot.tasks import longbench, ruler
from kvpot.tasks import text_metrics as tm
from kvpot.tasks.suites import load_items, score_item

FIXTURES = Path(__file__).parent / "fixtures"
LONGBENCH, INFINITEBENCH, RULER = FIXTURES / "longbench", FIXTURES / "infinitebench", FIXTURES / "ruler"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# ---------------------------------------------------------------------------- metrics


def test_qa_f1_uses_squad_normalisation():
    assert tm.normalize_answer("The  Grey Heron!") == "grey heron"
    assert tm.qa_f1("the Grey Heron.", "Grey Heron") == 1.0
    # pred {a, brass, compass, box} after dropping "a": 3 tokens, 2 shared with 2 -> P 2/3, R 1
    assert tm.qa_f1("a brass compass box", "the brass compass") == pytest.approx(0.8)
    assert tm.qa_f1("nothing here", "brass compass") == 0.0


def test_rouge_l_is_the_lcs_f1_over_words():
    # LCS of "the cat sat on the mat" / "the cat lay on a mat" = the cat on mat (4): P = R = 4/6
    assert tm.rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(4 / 6)
    assert tm.rouge_l("", "anything") == 0.0
    assert tm.lcs_length("ABCBDAB", "BDCABA") == 4


def test_edit_similarity_is_fuzzywuzzys_ratio_of_the_first_code_line():
    # kitten / sitting: LCS "ittn" = 4 -> 2 * 4 / 13 = 0.615 -> fuzz.ratio 62
    assert tm.levenshtein_ratio("kitten", "sitting") == pytest.approx(8 / 13)
    assert tm.edit_similarity("kitten", "sitting") == 0.62
    # comment and fence lines are skipped; the first plain line is compared
    assert tm.edit_similarity("\n# a comment\n```\nx = 1\ny = 2", "x = 1") == 1.0


def test_classification_retrieval_and_count_follow_longbench():
    classes = ["Location", "Other location", "Individual"]
    assert tm.classification("Other location", "Other location", classes) == 1.0  # "Location" is part of it
    assert tm.classification("Individual or Location", "Location", classes) == 0.5
    assert tm.classification("Date", "Location", classes) == 0.0
    assert tm.retrieval("Paragraph 2", "Paragraph 2") == 1.0
    assert tm.retrieval("Paragraph 2 or 3", "Paragraph 2") == 0.5
    assert tm.count("There are 4 unique paragraphs, not 5", "4") == 0.5
    with pytest.raises(KvpotError, match="Paragraph N"):
        tm.retrieval("1", "the second one")


def test_ruler_metrics_and_postprocessing():
    assert tm.ruler_all("Values: 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert tm.ruler_part("It was at DAWN.", ["at dawn", "dusk"]) == 1.0
    assert tm.ruler_postprocess("  a\x00b\tc ") == "a\nb\nc"


@pytest.mark.skipif(importlib.util.find_spec("jieba") is not None, reason="jieba is installed")
def test_chinese_tasks_without_jieba_fail_in_one_line(tmp_path):
    with pytest.raises(KvpotError, match=r"kvpot\[zh\]"):
        tm.qa_f1_zh("北京", "北京")
    row = {k: "" for k in longbench.FIELDS} | {"context": "文", "answers": ["a"], "length": 1}
    (tmp_path / "dureader.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(KvpotError, match="jieba"):
        load_items("longbench", data_dir=tmp_path, tasks=["dureader"])


# ---------------------------------------------------------------------------- LongBench


def test_longbench_prompts_are_the_published_templates_split_after_the_context():
    items = load_items("longbench", data_dir=LONGBENCH)
    assert {i.task for i in items} == {"narrativeqa", "hotpotqa", "trec", "passage_retrieval_en", "lcc", "gov_report"}
    rows = {json.loads(line)["_id"]: json.loads(line) for f in LONGBENCH.glob("*.jsonl")
            for line in f.read_text().splitlines()}
    for item in items:
        template, max_new, _ = longbench.CONFIG[item.task]
        row = rows[item.id]
        assert item.context + item.question == template.format(context=row["context"], input=row["input"])
        assert item.context.endswith(row["context"]) and item.max_new_tokens == max_new
        assert item.chat == (item.task not in ("trec", "lcc"))
    assert longbench.CONFIG["narrativeqa"][1] == 128 and longbench.CONFIG["hotpotqa"][1] == 32
    assert longbench.CONFIG["gov_report"][1] == 512 and longbench.CONFIG["lcc"][1] == 64
    hotpot = next(i for i in items if i.task == "hotpotqa")
    assert hotpot.question.startswith("\n\nAnswer the question based on the given passages.")
    assert hotpot.question.endswith("Question: " + rows[hotpot.id]["input"] + "\nAnswer:")


def test_longbench_scores_each_task_with_its_metric():
    items = {(i.task, i.index): i for i in load_items("longbench", data_dir=LONGBENCH)}
    assert score_item(items["narrativeqa", 1], " Grey Heron.") == 1.0  # F1 against its best answer
    assert score_item(items["trec", 1], "Number of something\nQuestion: ...") == 1.0  # first line only
    assert score_item(items["trec", 1], "\nIndividual") == 0.0
    assert score_item(items["passage_retrieval_en", 0], "Paragraph 2") == 1.0
    assert score_item(items["lcc", 0], "    p = perimeter(width, height)\n    return") == 1.0
    assert 0 < score_item(items["gov_report", 0], "The board will replace the gates first.") < 1


def test_longbench_groups_items_by_longbench_e_length_range():
    assert [longbench.length_group(n) for n in (10, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    assert {i.group for i in load_items("longbench", data_dir=LONGBENCH)} == {"0-4k"}


def test_longbench_samples_keep_the_first_items_of_each_task():
    items = load_items("longbench", data_dir=LONGBENCH, tasks=["narrativeqa", "trec"], samples=1)
    assert [(i.task, i.index) for i in items] == [("narrativeqa", 0), ("trec", 0)]


def test_longbench_bad_data_is_one_line_naming_the_files_expected(tmp_path):
    with pytest.raises(KvpotError, match=r"narrativeqa\.jsonl"):
        load_items("longbench", data_dir=tmp_path / "missing")
    with pytest.raises(KvpotError, match=r"holds no longbench data; expected files such as narrativeqa\.jsonl"):
        load_items("longbench", data_dir=tmp_path)
    with pytest.raises(KvpotError, match=r"lacks qasper\.jsonl"):
        load_items("longbench", data_dir=LONGBENCH, tasks=["qasper"])
    with pytest.raises(KvpotError, match="has no task 'nope'"):
        load_items("longbench", data_dir=LONGBENCH, tasks=["nope"])
    (tmp_path / "hotpotqa.jsonl").write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(KvpotError, match=r"hotpotqa\.jsonl:1 lacks answers, length"):
        load_items("longbench", data_dir=tmp_path)
    (tmp_path / "hotpotqa.jsonl").write_text("not json\n")
    with pytest.raises(KvpotError, match=r"hotpotqa\.jsonl:1 is not JSON"):
        load_items("longbench", data_dir=tmp_path)


# ---------------------------------------------------------------------------- InfiniteBench


def test_infinitebench_prompts_labels_and_scores():
    items = {i.task: i for i in load_items("infinitebench", data_dir=INFINITEBENCH)}
    assert set(items) == {"passkey", "kv_retrieval", "longbook_qa_eng", "longbook_choice_eng", "math_find", "code_debug"}
    passkey = items["passkey"]
    assert passkey.question == "\n\nWhat is the pass key?\n\nThe pass key is" and passkey.max_new_tokens == 6
    assert score_item(passkey, " 48213.") == 1.0 and score_item(passkey, " 4821") == 0.0
    assert score_item(items["kv_retrieval"], ' "a7b8".') == 1.0 and score_item(items["kv_retrieval"], " a7b89") == 0.0
    choice = items["longbook_choice_eng"]
    assert choice.extra["label"] == ["At the bridge", "C"]
    assert choice.question.endswith("C. At the bridge\nD. At the church\n\nThe letter of the correct answer is")
    assert score_item(choice, "C") == 1.0 and score_item(choice, " the answer is C") == 1.0
    assert score_item(choice, "B") == 0.0
    math = items["math_find"]
    assert math.context.startswith("What is the largest number in the following list?\n\n[12, 7, 93")
    assert score_item(math, " 93") == 1.0 and score_item(math, " 66") == 0.0
    debug = items["code_debug"]
    assert score_item(debug, "B.") == 1.0 and score_item(debug, "The answer is: halve") == 1.0
    assert score_item(items["longbook_qa_eng"], " Rope.") == 1.0


def test_infinitebench_refuses_an_answer_outside_the_options(tmp_path):
    row = {"id": 0, "context": "c", "input": "q", "answer": ["E"], "options": ["A1", "B1", "C1", "D1"]}
    (tmp_path / "longbook_choice_eng.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(KvpotError, match="not among the options"):
        load_items("infinitebench", data_dir=tmp_path)


# ---------------------------------------------------------------------------- RULER


def test_ruler_synthetic_tasks_at_a_length(tokenizer):
    items = load_items("ruler", tokenizer=tokenizer, lengths=[2048], samples=1, seed=3)
    assert [i.task for i in items] == [*ruler.GENERATED, "cwe", "fwe"]
    for item in items:
        context, question = item.make_ids()
        if item.task in ruler.GENERATED:
            assert len(context) == 2048  # kvpot's generators: exact length
            text = tokenizer.decode(context)
            assert all(answer in text for answer in item.answers)
        else:
            assert len(context) + len(question) <= 2048
        assert item.max_new_tokens == ruler.MAX_NEW[ruler.task_config(item.task)]
    multiquery = next(i for i in items if i.task == "niah_multiquery")
    assert len(multiquery.answers) == 4


def test_ruler_cwe_and_fwe_answers_are_the_most_frequent_words(tokenizer):
    (context, question), answers = ruler.cwe(tokenizer, 2048, seed=1)
    # the one-shot example comes first; the list asked about follows the last instruction
    listed = re.findall(r"\d+\. ([a-z]+)", context.rsplit("Memorize the ones that appear most often.\n", 1)[1])
    counts = Counter(listed)
    assert sorted(answers) == sorted(w for w, _ in counts.most_common(10))
    assert min(counts[w] for w in answers) > max(c for w, c in counts.items() if w not in answers)
    assert question.endswith(ruler.CWE_PREFIX) and context.startswith("Below is a numbered list")
    (context, question), answers = ruler.fwe(tokenizer, 2048, seed=1)
    counts = Counter(context.split("coded words. ", 1)[1].split())
    assert [w for w, _ in counts.most_common(4)] == ["...", *answers]


def test_ruler_qa_puts_the_gold_paragraph_among_distractors(tokenizer):
    items = load_items("ruler", data_dir=RULER, tasks=["qa_1", "qa_2"], tokenizer=tokenizer, lengths=[1024],
                       samples=2)
    assert [(i.task, i.answers) for i in items] == [("qa_1", ["ninety"]), ("qa_1", ["at dawn"]),
                                                    ("qa_2", ["Kelmar"]), ("qa_2", ["grain"])]
    for item in items:
        context, question = (tokenizer.decode(ids) for ids in item.make_ids())
        assert context.startswith("Answer the question based on the given documents.") and "Document 1:\n" in context
        assert question.endswith(" Answer:") and item.max_new_tokens == 32
    first = tokenizer.decode(items[0].make_ids()[0])
    assert "ninety steps" in first and "Document 3:" in first  # all four paragraphs fit in 1024 bytes
    assert score_item(items[0], " Ninety steps.") == 1.0 and score_item(items[0], " eighty") == 0.0


def test_ruler_qa_needs_its_files(tmp_path, tokenizer):
    with pytest.raises(KvpotError, match=r"lacks squad\.json"):
        load_items("ruler", data_dir=tmp_path, tasks=["qa_1"], tokenizer=tokenizer, lengths=[1024])
    (tmp_path / "hotpotqa.json").write_text('{"not": "a list"}')
    with pytest.raises(KvpotError, match="expected HotpotQA's hotpot_dev_distractor_v1.json"):
        load_items("ruler", data_dir=tmp_path, tasks=["qa_2"], tokenizer=tokenizer, lengths=[1024])
    with pytest.raises(KvpotError, match="smallest prompt takes [0-9]+ tokens"):
        ruler.cwe(tokenizer, 256, seed=0)


# ---------------------------------------------------------------------------- kvpot eval


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_longbench_writes_the_usual_outputs(capsys, tiny_dir, tmp_path):
    out = tmp_path / "lb"
    code, stdout, _ = run(capsys, "eval", "longbench", "--data-dir", str(LONGBENCH), "--tasks",
                          "narrativeqa,passage_retrieval_en,trec", "--samples", "2", "--method", "full",
                          "--method", "streaming:sinks=4,window=60", "--max-new-tokens", "4",
                          "--model", str(tiny_dir), "--out", str(out))
    assert code == 0
    rows = read_rows(out / "results.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    bound = summary["methods"]["streaming"]["max_entries"]
    assert len(rows) == 3 * 2 * 2
    for row in rows:
        assert row["task"] == "longbench" and row["max_new_tokens"] == 4 and row["group"] == "0-4k"
        assert row["stats"]["context_tokens"] + row["stats"]["question_tokens"] == row["length"]
        if row["method"] == "streaming":
            assert row["method_config"]["window"] == 60 and row["stats"]["max_kv_entries"] <= bound
        else:
            assert row["stats"]["max_kv_entries"] >= row["length"]
    # Every method answered the same items and got the benchmark's score for its prediction.
    items = {(i.task, i.id): i for i in load_items("longbench", data_dir=LONGBENCH)}
    for row in rows:
        assert row["score"] == score_item(items[row["subtask"], row["id"]], row["prediction"])
    assert summary["tasks"] == ["narrativeqa", "passage_retrieval_en", "trec"] and summary["groups"] == ["0-4k"]
    for label in ("full", "streaming"):
        mine = [r for r in rows if r["method"] == label]
        per_task = {t: sum(r["score"] for r in mine if r["subtask"] == t) / 2 for t in summary["tasks"]}
        assert summary["scores"][label] == pytest.approx(per_task)
        assert summary["overall"][label] == pytest.approx(sum(per_task.values()) / 3)
    assert summary["config"]["data_dir"] == str(LONGBENCH)
    assert "| method | narrativeqa | passage_retrieval_en | trec | mean |" in (out / "summary.md").read_text()
    assert_png(out / "scores.png")
    assert "score x 100 by task" in stdout


def test_eval_ruler_reports_by_length(capsys, tiny_dir, tmp_path):
    out = tmp_path / "ruler"
    code, _, _ = run(capsys, "eval", "ruler", "--tasks", "niah_single_1,vt", "--lengths", "256,512", "--samples", "1",
                     "--templates", "0", "--method", "full", "--max-new-tokens", "2", "--model", str(tiny_dir),
                     "--out", str(out))
    assert code == 0
    rows = read_rows(out / "results.jsonl")
    assert sorted((r["subtask"], r["group"]) for r in rows) == [("niah_single_1", "256"), ("niah_single_1", "512"),
                                                               ("vt", "256"), ("vt", "512")]
    assert all(r["stats"]["context_tokens"] == int(r["group"]) + 1 for r in rows)  # + BOS
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups"] == ["256", "512"] and set(summary["by_group"]["full"]) == {"256", "512"}
    assert "full by context length" in (out / "summary.md").read_text()
    assert_png(out / "accuracy.png")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["longbench", "--data-dir", "/nonexistent/lb"], "is not a folder; longbench expects it to hold narrativeqa.jsonl"),
        (["infinitebench"], "give --data-dir DIR holding passkey.jsonl"),
        (["passkey", "--data-dir", "x"], "--data-dir and --tasks are for the benchmarks"),
        (["longbench", "--data-dir", str(LONGBENCH), "--task-set", "k=1"], "takes no --task-set"),
    ],
)
def test_eval_benchmark_errors_are_one_line(capsys, tiny_dir, tmp_path, argv, fragment):
    code, _, err = run(capsys, "eval", *argv, "--method", "full", "--model", str(tiny_dir),
                       "--out", str(tmp_path / "out"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
    assert not (tmp_path / "out").exists()
