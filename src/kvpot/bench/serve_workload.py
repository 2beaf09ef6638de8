"""What `kvpot bench serve`'s users send, as text, and the tokenizer a random-weight shape is served with.

A shape has no tokenizer, so its server gets a word-level one: word `t{i}` is token `i`, words are
split on whitespace and decoded joined by spaces. A prompt of K tokens is then the text of K words
(`"t17 t3051 ..."`), and context lengths are exact. The ids are the ones `kvpot bench throughput`
draws for the same seed, so the `[engine]` row reads the very tokens the server is sent.

Against any other server (`--url`, or a launched `--model`) prompts are common English words,
about one token each for the usual BPE vocabularies: lengths are approximate there (the usage
chunk's `prompt_tokens` says what the server counted).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# common words, most a single token (with their leading space) in Llama, Mistral and Qwen vocabularies
WORDS = (
    "the of and to in is was for that on as with by he at from his it an were are which this be or had not "
    "but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made group three while between around people "
    "both part under high before however well team year war several also until game house river north south "
    "life age found long film music work large early day name back place water small power light market"
).split()


def word_tokenizer(vocab_size: int, bos_id: int | None, eos_id: int | None):
    """A fast tokenizer where `t{i}` is token i, for every id of the model (no chat template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder puts a space before every token without its (unused) `##` prefix
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)

    def word(index: int):  # special tokens are matched before splitting: whole words only, or `t1` eats `t10`
        return AddedToken(f"t{index}", single_word=True, special=True, normalized=False)

    special = {name: word(index) for name, index in (("bos_token", bos_id), ("eos_token", eos_id))
               if index is not None and 0 <= index < vocab_size}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=word(0), **special)


def ids_text(ids) -> str:
    """Token ids as the word tokenizer's text."""
    return " ".join(f"t{int(i)}" for i in ids)


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass
class Workload:
    """The texts of one length: each user's context (empty with a document) and question."""

    contexts: list[str]
    questions: list[str]
    document: str | None
    ids: dict | None = None  # launched: the same prompts as token ids, in `bench throughput`'s form
    plan: dict | None = None  # per user: arrival, context length, new tokens (kvpot.bench.load.workload_plan)


def text_workload(config, length: int, prefix: str = "") -> Workload:
    """Words, about `length` tokens per context (a server whose tokenizer is not ours). `prefix` opens
    every context and document: a word of its own per run keeps a server's prefix cache (or kvpot's
    stored states) of an earlier run from answering this one. With `--length-mix`, each user's context
    is its drawn length in words."""
    from kvpot.bench.load import workload_plan

    plan = workload_plan(config, length)
    questions = [" " + words(config.question_tokens, config.seed + 7919 * (user + 1)) for user in range(config.users)]
    if config.document:
        return Workload([""] * config.users, questions, prefix + words(length, config.seed + length), plan=plan)
    contexts = [prefix + words(n, config.seed + n + 104729 * (user + 1)) for user, n in enumerate(plan["lengths"])]
    return Workload(contexts, questions, None, plan=plan)


def exact_workload(bench_config, model, tokenizer, length: int, word_level: bool) -> Workload:
    """Texts and the ids the server will read from them: `bench throughput`'s ids written as words
    (word-level tokenizer), or words encoded by the model's tokenizer as the server encodes them."""
    if word_level:
        from kvpot.bench.throughput import _prompts

        ids = _prompts(bench_config, model, length)
        document = None if ids["document"] is None else ids_text(ids["document"].tolist())
        contexts = [""] * bench_config.users if document else [ids_text(c.tolist()) for c in ids["contexts"]]
        return Workload(contexts, [" " + ids_text(q.tolist()) for q in ids["questions"]], document, ids, ids["plan"])
    texts = text_workload(bench_config, length)
    texts.ids = {**_encoded(texts, tokenizer, bench_config.device), "plan": texts.plan}
    return texts


def _encoded(texts: Workload, tokenizer, device: str) -> dict:
    """Token ids as kvpot's server makes them without a chat template: a context (or document) with
    the tokenizer's special tokens, a question without."""
    import torch

    def ids(text: str, special: bool):
        return torch.tensor(tokenizer.encode(text, add_special_tokens=special), dtype=torch.long, device=device)

    questions = [ids(q, False) for q in texts.questions]
    if texts.document is not None:
        document = ids(texts.document, True)
        return {"document": document, "contexts": [document] * len(questions), "questions": questions}
    return {"document": None, "contexts": [ids(c, True) for c in texts.contexts], "questions": questions}


def upload_text(tokens: int, seed: int, vocab: int | None) -> str:
    """The document uploaded while users decode: `tokens` random words (exact with a word-level vocab)."""
    if vocab is None:
        return words(tokens, seed)
    rng = random.Random(seed)
    return " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(tokens))
