"""RULER (Hsieh et al. 2024) at any length: kvpot's generators with RULER's templates and scoring.

Tasks and how they are built (RULER's ``synthetic.yaml`` settings):

===================  ========================================================================
niah_single_1        kvpot ``niah`` on the ``repeat`` haystack (RULER's "noise": the grass is green...)
niah_single_2        kvpot ``niah`` on the ``varied`` prose haystack (RULER: Paul Graham essays)
niah_single_3        the same with UUID values (``value_format="uuid"``)
niah_multikey_1      ``niah`` with 4 keys, one asked (varied haystack)
niah_multikey_2      ``niah`` on a haystack of needles (``haystack="needles"``): each line a
                     needle with its own word key and 7-digit value; one key asked
niah_multikey_3      the same with UUID keys and UUID values
niah_multivalue      ``niah`` with 4 values for the key asked
niah_multiquery      ``niah`` with 4 keys, all asked
vt                   kvpot ``vt``: one chain of 4 hops
cwe                  common words: 10 words 30 times, the others 3 times (6 and 1 below 4K tokens),
                     in a numbered list, after RULER's one-shot example
fwe                  frequent words: coded 6-letter words drawn from a Zipf law (alpha 2)
qa_1 / qa_2          SQuAD v2 / HotpotQA questions over their gold paragraphs and distractors,
                     ``Document i:`` each (local files ``squad.json`` / ``hotpotqa.json``)
===================  ========================================================================

kvpot's niah and vt speak RULER's wording in their template 0 (keys are adjective-noun words, values
7-digit numbers or UUIDs); like cwe and fwe, they have two more wordings (issue 32: a score on one
wording measures the wording too), which ``load(templates=...)`` spreads samples over (qa keeps
RULER's one template). The haystack of needles (:mod:`kvpot.tasks.needle_haystack`) holds whole
needles only, their keys all distinct. cwe's words are made-up syllable words (RULER draws English
words from the wonderwords package). Depths of niah and vt needles are drawn per sample, seeded.
Lengths: niah/vt contexts are exactly the length asked (a haystack's partial sentence or needle at
either end of it is newlines); cwe/fwe/qa prompts (context and question) are the longest that fit in it.

Scoring is RULER's: ``string_match_all`` (fraction of references found in the prediction, case
ignored) for every task but qa, which takes ``string_match_part`` (any reference found);
predictions first go through RULER's ``postprocess_pred``. Generation lengths: niah 128, vt 30,
cwe 120, fwe 50, qa 32 tokens.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpot.errors import KvpotError
from kvpot.tasks import text_metrics as tm
from kvpot.tasks.suites import Item, data_path

#: task -> (kvpot generator, its options)
GENERATED: dict[str, tuple[str, dict]] = {
    "niah_single_1": ("niah", {"haystack": "repeat"}),
    "niah_single_2": ("niah", {"haystack": "varied"}),
    "niah_single_3": ("niah", {"haystack": "varied", "value_format": "uuid"}),
    "niah_multikey_1": ("niah", {"haystack": "varied", "num_keys": 4}),
    "niah_multikey_2": ("niah", {"haystack": "needles"}),
    "niah_multikey_3": ("niah", {"haystack": "needles", "key_format": "uuid", "value_format": "uuid"}),
    "niah_multivalue": ("niah", {"haystack": "varied", "num_values": 4}),
    "niah_multiquery": ("niah", {"haystack": "varied", "num_keys": 4, "num_queries": 4}),
    "vt": ("vt", {"haystack": "repeat", "num_chains": 1, "num_hops": 4}),
}
QA_FILES = {"qa_1": "squad.json", "qa_2": "hotpotqa.json"}
TASKS = (*GENERATED, "cwe", "fwe", *QA_FILES)
MAX_NEW = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                "words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three "
                "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
                "Please ignore the dots '....'. What are the three most frequently appeared words in the "
                "above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
#: (instruction with {context}, answer prefix) per template; 0 is RULER's
CWE_TEMPLATES = (
    (CWE_TEMPLATE, CWE_PREFIX),
    ("Here is a long numbered list of words; a few of them come up far more often than the rest.\n{context}\n"
     "Question: Which 10 words come up most often in the list above?",
     " Answer: The 10 words that come up most often are:"),
    ("Count how often each word occurs in the numbered list below.\n{context}\nQuestion: Name the ten words "
     "that occur most frequently in the list.", " Answer: The ten most frequent words are:"),
)
FWE_TEMPLATES = (
    (FWE_TEMPLATE, FWE_PREFIX),
    ("The coded text below is made of invented words, some repeated many times. Keep count of them. {context}\n"
     "Question: Ignore the dots '....'. Which three coded words occur most often in the text above? Give no "
     "explanation.", " Answer: The three coded words that occur most often are:"),
    ("Read the coded text and count its words. {context}\nQuestion: Without any explanation, and ignoring the "
     "dots '....', name the three most frequent coded words.", " Answer: The three most frequent coded words are:"),
)
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output "
               "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
               "based on the given documents. Only give me the answer and do not output any other words.\n\n"
               "Question: {query}")
QA_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"

_CONSONANTS, _VOWELS = "bcdfghjklmnprstvz", "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]


def task_config(task: str) -> str | None:
    """The RULER base task of ``task`` (niah, vt, cwe, fwe, qa)."""
    if task in GENERATED:
        return GENERATED[task][0]
    return {"cwe": "cwe", "fwe": "fwe"}.get(task) or ("qa" if task in QA_FILES else None)


def files(task: str) -> list[str]:
    return [QA_FILES[task]] if task in QA_FILES else []


def _seed(*parts: Any) -> int:
    return int(hashlib.sha256("/".join(map(str, ("kvpot-ruler", *parts))).encode()).hexdigest()[:8], 16)


# ---------------------------------------------------------------------------- fitting a length


def _fit(build: Callable[[int], tuple[str, str]], tokenizer, length: int, start: int, what: str,
         limit: int | None = None) -> tuple[str, str]:
    """The (context, question) of the largest size ``n <= limit`` whose prompt has at most ``length`` tokens.

    Sizes grow by doubling, then a bisection finds the edge (token counts grow with ``n``).
    """
    def tokens(n: int) -> int:
        context, question = build(n)
        return len(tokenizer.encode(context + question, add_special_tokens=False))

    low = start
    smallest = tokens(low)
    if smallest > length:
        raise KvpotError(f"ruler {what}: its smallest prompt takes {smallest} tokens of this tokenizer, more than "
                         f"the {length} asked; give a longer length (or leave {what} out with --tasks).")
    high = low * 2
    while tokens(high) <= length:
        if limit is not None and high >= limit:
            return build(limit)
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if tokens(mid) <= length else (low, mid)
    return build(low)


def _ids(tokenizer, context: str, question: str) -> tuple[list[int], list[int]]:
    return (list(tokenizer.encode(context, add_special_tokens=False)),
            list(tokenizer.encode(question, add_special_tokens=False)))


# ---------------------------------------------------------------------------- cwe / fwe


def _words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct three-syllable made-up words."""
    picks = rng.sample(range(len(_SYLLABLES) ** 3), n)
    return ["".join(_SYLLABLES[p // len(_SYLLABLES) ** k % len(_SYLLABLES)] for k in range(3)) for p in picks]


def _word_list(rng: random.Random, n: int, common: int, uncommon: int) -> tuple[str, list[str]]:
    words = _words(rng, n)
    top, rest = words[:10], words[10:]
    listed = top * common + rest * uncommon
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


def cwe(tokenizer, length: int, seed: int, template: int = 0) -> tuple[tuple[str, str], list[str]]:
    """RULER common-words extraction: (context, question), answers; worded by ``CWE_TEMPLATES[template]``."""
    instruction, prefix = CWE_TEMPLATES[template]
    small = length < 4096  # RULER's settings for short contexts
    example_rng = random.Random(_seed("cwe-example", seed))
    listed, top = _word_list(example_rng, 20 if small else 40, 3 if small else 10, 1 if small else 3)
    example = (instruction.format(context=listed) + prefix + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(top)))
    answers: list[str] = []

    def build(n: int) -> tuple[str, str]:
        context, answer = _word_list(random.Random(_seed("cwe", seed)), n, 6 if small else 30, 1 if small else 3)
        answers[:] = answer
        head, tail = instruction.split("{context}")
        return example + "\n" + head + context, tail + prefix

    fitted = _fit(build, tokenizer, length, 11, "cwe")
    return fitted, list(answers)


def _zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta for alpha > 1: a partial sum plus the Euler-Maclaurin tail."""
    partial = sum(k ** -alpha for k in range(1, terms + 1))
    return partial + terms ** (1 - alpha) / (alpha - 1) - terms ** -alpha / 2


def fwe(tokenizer, length: int, seed: int, alpha: float = 2.0, template: int = 0) -> tuple[tuple[str, str], list[str]]:
    """RULER frequent-words extraction: (context, question), the three most frequent coded words;
    worded by ``FWE_TEMPLATES[template]``."""
    instruction, prefix = FWE_TEMPLATES[template]
    rng = random.Random(_seed("fwe", seed))
    size = max(length // 50, 8)  # RULER's vocabulary size
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # RULER: the most frequent "word" is noise
    zeta = _zeta(alpha)

    def build(n: int) -> tuple[str, str]:
        words = [w for k, w in enumerate(ranked, 1) for _ in range(int(n * k ** -alpha / zeta))]
        random.Random(_seed("fwe-order", seed)).shuffle(words)
        head, tail = instruction.split("{context}")
        return head + " ".join(words), tail + prefix

    return _fit(build, tokenizer, length, 16, "fwe"), ranked[1:4]


# ---------------------------------------------------------------------------- qa


def read_qa(path: Path, task: str) -> tuple[list[dict], list[str]]:
    """RULER's reading of SQuAD v2 (answerable questions) or HotpotQA (distractor dev set)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise KvpotError(f"{path} is not readable JSON ({err}); expected {_expected(task)}.") from None
    try:
        if task == "qa_1":
            docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
            index = {c: i for i, c in enumerate(docs)}
            qas = []
            for d in data["data"]:
                near = [index[p["context"]] for p in d["paragraphs"]]
                for p in d["paragraphs"]:
                    for qa in p["qas"]:
                        if not qa.get("is_impossible", False):
                            gold = index[p["context"]]
                            qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                        "gold": [gold], "near": [i for i in near if i != gold]})
        else:
            text = [[f"{title}\n{''.join(sentences)}" for title, sentences in d["context"]] for d in data]
            docs = sorted({t for group in text for t in group})
            index = {c: i for i, c in enumerate(docs)}
            qas = [{"query": d["question"], "outputs": [d["answer"]], "gold": [index[t] for t in group], "near": []}
                   for d, group in zip(data, text)]
    except (KeyError, TypeError, ValueError):
        raise KvpotError(f"{path} does not have the expected layout; expected {_expected(task)}.") from None
    if not qas:
        raise KvpotError(f"{path} holds no answerable question.")
    return qas, docs


def _expected(task: str) -> str:
    return ("SQuAD v2.0's dev-v2.0.json (data -> paragraphs -> context, qas)" if task == "qa_1"
            else "HotpotQA's hotpot_dev_distractor_v1.json (a list of question, answer, context)")


def qa(tokenizer, length: int, seed: int, qas: list[dict], docs: list[str], index: int):
    """One RULER QA prompt: the question's gold documents and distractors, shuffled, fit to length."""
    entry = qas[index % len(qas)]
    others = [i for i in range(len(docs)) if i not in entry["gold"] and i not in entry["near"]]
    order = random.Random(_seed("qa", seed, index))
    distractors = order.sample(others, len(others))

    def build(n: int) -> tuple[str, str]:
        extra = max(0, n - len(entry["gold"]))
        chosen = entry["gold"] + (entry["near"] + distractors)[:extra]
        chosen = [docs[i] for i in chosen]
        random.Random(_seed("qa-shuffle", seed, index)).shuffle(chosen)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        head, tail = QA_TEMPLATE.split("{context}")
        return head + context, tail.format(query=entry["query"]) + QA_PREFIX

    limit = len(entry["gold"]) + len(entry["near"]) + len(distractors)
    fitted = _fit(lambda n: build(min(n, limit)), tokenizer, length, max(1, len(entry["gold"])), "qa", limit)
    return fitted, entry["outputs"]


# ---------------------------------------------------------------------------- suite API


def load(data_dir: str | Path | None, tasks: Sequence[str] | None, samples: int | None, tokenizer: Any = None,
         lengths: Sequence[int] = (), seed: int = 0, templates: Sequence[int] | None = None,
         chats: Sequence[bool] = (False,), **_: Any) -> list[Item]:
    """``samples`` items per task, length, template (of those the task has; None: template 0) and chat flag
    (True: the caller wraps the prompt in the model's chat template, ``Item.chat``); each its own seed."""
    if tokenizer is None or not lengths:
        raise KvpotError("ruler builds its contexts for a tokenizer at given lengths; pass tokenizer= and lengths=.")
    samples = 5 if samples is None else samples
    qa_sets: dict[str, tuple[list[dict], list[str]]] = {}
    if tasks is None:
        tasks = list(GENERATED) + ["cwe", "fwe"]
        if data_dir is not None:
            path = data_path(data_dir, "ruler", list(QA_FILES.values()))
            tasks += [t for t, f in QA_FILES.items() if (path / f).is_file()]
    for task in tasks:
        if task in QA_FILES:
            path = data_path(data_dir, "ruler", list(QA_FILES.values()))
            if not (path / QA_FILES[task]).is_file():
                raise KvpotError(f"ruler task {task}: {path} lacks {QA_FILES[task]} ({_expected(task)}).")
            qa_sets[task] = read_qa(path / QA_FILES[task], task)
    items = []
    for task in tasks:
        base = task_config(task)
        for length in lengths:
            for template in [t for t in (templates or [0]) if t < template_count(task)]:
                for chat in chats:
                    for index in range(samples):
                        tail = (f"/t{template}" if template else "") + ("/chat" if chat else "")
                        # template 0 without a chat template keeps the seeds of runs made before either existed
                        sample_seed = _seed(seed, task, length, index, tail) if tail else _seed(seed, task, length,
                                                                                               index)
                        make, answers = _maker(task, tokenizer, length, sample_seed, qa_sets.get(task), index,
                                               template)
                        items.append(Item(suite="ruler", task=task, index=index, id=f"{task}/{length}/{index}{tail}",
                                          answers=answers, max_new_tokens=MAX_NEW[base], group=str(length),
                                          make_ids=make, chat=chat,
                                          extra={"seed": sample_seed, "template": template, "chat": chat}))
    return items


def template_count(task: str) -> int:
    """How many wordings ``task`` has: niah and vt those of kvpot's generators, cwe and fwe three, qa one."""
    from kvpot.tasks.wording import template_count as generated_count

    if task in GENERATED:
        return generated_count(GENERATED[task][0])
    return {"cwe": len(CWE_TEMPLATES), "fwe": len(FWE_TEMPLATES)}.get(task, 1)


def _maker(task: str, tokenizer, length: int, seed: int, qa_set, index: int, template: int = 0):
    """(a function building the item's ids, the answers); generated samples are built when run."""
    if task in GENERATED:
        from kvpot.tasks.generators import make_sample

        name, options = GENERATED[task]
        depth = round(random.Random(seed).uniform(0.0, 1.0), 3)

        def make() -> tuple[list[int], list[int]]:  # built when run, not kept: contexts can be long
            sample = make_sample(name, tokenizer, length, depth=depth, seed=seed, template=template, **options)
            return sample.context_ids, sample.question_ids

        # the needles depend on the seed, not the length, so a short sample gives the answers cheaply
        probe = make_sample(name, tokenizer, 2048, depth=depth, seed=seed, template=template, **options)
        return make, list(probe.answers)
    if task == "cwe":
        (context, question), answers = cwe(tokenizer, length, seed, template=template)
    elif task == "fwe":
        (context, question), answers = fwe(tokenizer, length, seed, template=template)
    else:
        (context, question), answers = qa(tokenizer, length, seed, *qa_set, index)
    return (lambda: _ids(tokenizer, context, question)), list(answers)


def score(item: Item, prediction: str) -> float:
    prediction = tm.ruler_postprocess(prediction)
    if task_config(item.task) == "qa":
        return tm.ruler_part(prediction, item.answers)
    return tm.ruler_all(prediction, item.answers)
