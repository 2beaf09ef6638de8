"""The chat dimension of `kvpot eval`: a sample read as plain text, or inside the model's chat template.

A chat model meets its prompts wrapped in its template (a system turn, `<|im_start|>user ...`), and a
score measured only without it (or only with it) measures that choice too (issue 32). So the
synthetic tasks and RULER run each sample `--chat both` ways where the tokenizer has a chat template
(`plain` only where it has none), as one more dimension of a cell: method x length x depth x
template x chat x sample, each combination seeded on its own.

The wrapping is `Engine.encode`'s (kvpress' pipeline placement) on token ids: the sample's exact
context ids after the template's head (everything before the user's text), the question after the
context, then the template's tail (end of turn and the generation prompt). Plain samples get the
tokenizer's special prefix (BOS) instead, as before.
"""

from __future__ import annotations

from kvpot.errors import KvpotError

CHAT_MODES = ("both", "plain", "chat")

#: generated beyond the default answer length in a chat turn: an assistant may restate the question first
CHAT_SLACK_TOKENS = 16

_SPLIT = "\u241ekvpot-sample\u241e"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_chat(mode: str, tokenizer) -> list[bool]:
    """The chat flags a run reads: `both` -> [False, True] with a chat template, [False] without one."""
    if mode not in CHAT_MODES:
        raise KvpotError(f"--chat must be one of {', '.join(CHAT_MODES)}, got {mode!r}.")
    has = has_chat_template(tokenizer)
    if mode == "chat" and not has:
        raise KvpotError("--chat chat: this tokenizer has no chat template; use --chat plain (or both).")
    return {"plain": [False], "chat": [True], "both": [False, True] if has else [False]}[mode]


def chat_parts(tokenizer) -> tuple[list[int], list[int]]:
    """(head ids, tail ids) of one user turn: what the chat template puts before and after its text."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SPLIT}], add_generation_prompt=True,
                                         tokenize=False)
    head, tail = text.split(_SPLIT)
    return (list(tokenizer.encode(head, add_special_tokens=False)),
            list(tokenizer.encode(tail, add_special_tokens=False)))


class Wrapper:
    """Puts a sample's ids in place for either chat flag (the template's parts computed once)."""

    def __init__(self, tokenizer, prefix: list[int]):
        self.prefix = list(prefix)
        self.parts = chat_parts(tokenizer) if has_chat_template(tokenizer) else None

    def __call__(self, context_ids, question_ids, chat: bool) -> tuple[list[int], list[int]]:
        if not chat:
            return self.prefix + list(context_ids), list(question_ids)
        if self.parts is None:
            raise KvpotError("a chat sample, but the tokenizer has no chat template.")
        head, tail = self.parts
        return head + list(context_ids), list(question_ids) + tail


def chat_label(chat: bool | None) -> str:
    return "chat" if chat else "plain"
