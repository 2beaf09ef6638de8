"""From OpenAI messages to kvpot's (context, question) token ids, and from tokens back to text.

kvpot reads a context once and answers questions placed after it. A chat request maps onto
that as follows (README, *Serving*):

- with `document_id`, the stored document is the context and the whole conversation follows it;
  with a chat template, the first user message continues the user turn the document opened,
  exactly as `Engine.generate(context, question)` places a question;
- without, the first user message is the context (with any system messages before it) and the
  rest of the conversation is the question.

Without a chat template (the bundled reference model is a plain LM), message contents are
concatenated verbatim, as `Engine.encode` appends a question.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from kvpot.serve.protocol import ApiError, Message

_SPLIT = "\u241ekvpot-split\u241e"
_DOC = "\u241ekvpot-document\u241e"


@dataclass
class Prompt:
    context_ids: list[int] | None  # None: a stored document is the context
    question_ids: list[int]


def _roles(messages: list[Message]) -> list[dict]:
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def chat_prompt(engine, messages: list[Message], document: bool) -> Prompt:
    """Token ids of a chat request (see the module docstring)."""
    turns = _roles(messages)
    users = [i for i, t in enumerate(turns) if t["role"] == "user"]
    if not users:
        raise ApiError(400, "the conversation has no user message.", param="messages")
    first = users[0]
    tok = engine.tokenizer
    if document and first != 0:
        raise ApiError(400, "with document_id the conversation must start with a user message: the document "
                            "opened the first user turn (put instructions in that message).", param="messages")
    if not engine._use_template():  # the engine's own rule (chat_template=auto/True/False)
        if document:
            return Prompt(None, tok.encode("".join(t["content"] for t in turns), add_special_tokens=False))
        context = "".join(t["content"] for t in turns[: first + 1])
        if not context:
            raise ApiError(400, "the first user message (the context) is empty.", param="messages")
        question = "".join(t["content"] for t in turns[first + 1 :])
        return Prompt(tok.encode(context, add_special_tokens=True),
                      tok.encode(question, add_special_tokens=False) if question else [])
    turns = [dict(t) for t in turns]
    if document:
        turns[first]["content"] = _DOC + _SPLIT + turns[first]["content"]
    else:
        if not turns[first]["content"]:
            raise ApiError(400, "the first user message (the context) is empty.", param="messages")
        turns[first]["content"] += _SPLIT
    try:
        text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # templates raise their own errors (e.g. roles out of order)
        raise ApiError(400, f"the model's chat template refused this conversation: {err}", param="messages") from None
    if text.count(_SPLIT) != 1:
        raise ApiError(400, "the model's chat template does not keep message text verbatim.", param="messages")
    head, tail = text.split(_SPLIT)
    question = tok.encode(tail, add_special_tokens=False)
    return Prompt(None if document else tok.encode(head, add_special_tokens=False), question)


def completion_prompt(engine, prompt: str | list[int], document: bool) -> Prompt:
    """A text completion's prompt: all context, or with a document all question (verbatim)."""
    tok = engine.tokenizer
    if isinstance(prompt, list):
        vocab = engine.model.get_input_embeddings().num_embeddings
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be integers in [0, {vocab}).", param="prompt")
        ids = list(prompt)
    else:
        if not prompt:
            raise ApiError(400, "the prompt is empty.", param="prompt")
        ids = tok.encode(prompt, add_special_tokens=not document)
    return Prompt(None, ids) if document else Prompt(ids, [])


class TextStream:
    """Tokens in, text pieces out: waits for whole UTF-8 characters, stops at a stop string
    (which is not returned) and holds back text that could be the start of one."""

    def __init__(self, tokenizer, stops: list[str], lock=None):
        self.tokenizer, self.stops = tokenizer, stops
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.tokens: list[int] = []
        self.sent = 0  # characters returned so far
        self.stopped = False
        # incremental detokenization: only tokens[prefix:] are decoded per token (a whole answer
        # decoded at every token costs its length squared); the text of tokens[prefix:read] is known
        self.done_text, self.prefix, self.read = "", 0, 0

    def _text(self) -> str | None:
        """The text of every token so far, or None while the last tokens end inside a character."""
        with self.lock:
            known = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
            full = self.tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return None
        # the window's text is decoded with a little context before it, since a token's text can
        # depend on its neighbour (a leading space); the context's text is cut off again
        self.done_text += full[len(known) :]
        self.prefix, self.read = self.read, len(self.tokens)
        return self.done_text

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self._text()
        if text is None:
            return ""  # an incomplete multi-byte character
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text[: min(hits)])
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._take(text[: len(text) - hold])

    def finish(self) -> str:
        """What is left once generation ended (held-back text that turned out not to be a stop)."""
        if self.stopped:
            return ""
        with self.lock:  # what is left undecoded (an unfinished character) is decoded as it is
            text = self.done_text + self.tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)[
                len(self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)) :]
        return self._take(text)

    def _take(self, upto: str) -> str:
        piece = upto[self.sent :]
        self.sent = max(self.sent, len(upto))
        return piece
