"""From OpenAI messages to kvpot's (context, question) token ids, and from tokens back to text.

kvpot reads a context once and answers questions placed after it. A chat request maps onto
that as follows (docs/serving.md):

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


def chat_prompt(engine, messages: list[Message], document: bool, tok=None) -> Prompt:
    """Token ids of a chat request (see the module docstring); `tok`: the tokenizer copy to encode with."""
    turns = _roles(messages)
    users = [i for i, t in enumerate(turns) if t["role"] == "user"]
    if not users:
        raise ApiError(400, "the conversation has no user message.", param="messages")
    first = users[0]
    tok = tok if tok is not None else engine.tokenizer
    if document and first != 0:
        raise ApiError(400, "with document_id the conversation must start with a user message: the document "
                            "opened the first user turn (put instructions in that message).", param="messages")
    if not engine.uses_chat_template():  # the engine's own rule (chat_template=auto/True/False)
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
    except Exception as err:  # noqa: BLE001 - templates raise their own errors (e.g. roles out of order)
        raise ApiError(400, f"the model's chat template refused this conversation: {err}", param="messages") from None
    if text.count(_SPLIT) != 1:
        raise ApiError(400, "the model's chat template does not keep message text verbatim.", param="messages")
    head, tail = text.split(_SPLIT)
    question = tok.encode(tail, add_special_tokens=False)
    return Prompt(None if document else tok.encode(head, add_special_tokens=False), question)


def completion_prompt(engine, prompt: str | list[int], document: bool, tok=None) -> Prompt:
    """A text completion's prompt: all context, or with a document all question (verbatim)."""
    tok = tok if tok is not None else engine.tokenizer
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


class StopMatcher:
    """Finds stop strings in text that arrives piece by piece, in time linear in the text: each stop's
    Knuth-Morris-Pratt automaton reads every character once (a search of the whole text, or of every
    prefix of a stop against its end, at each token costs the square of a long stop)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_failure(s) for s in stops]
        self.state = [0] * len(stops)  # per stop: the longest prefix of it that the text read so far ends with
        self.read = 0  # characters read

    def feed(self, text: str) -> int | None:
        """Read `text`, which follows what was read; the index (in the whole text) where the earliest stop
        that ends inside it begins, or None."""
        first = None
        for which, stop in enumerate(self.stops):
            fail, state = self.fail[which], self.state[which]
            for offset, char in enumerate(text):
                while state and (state == len(stop) or stop[state] != char):
                    state = fail[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    begin = self.read + offset + 1 - len(stop)
                    first = begin if first is None else min(first, begin)
                    break  # the earliest end of this stop: what follows it is cut anyway
            self.state[which] = state
        self.read += len(text)
        return first

    @property
    def partial(self) -> int:
        """Characters at the end of the text that may begin a stop (held back until the next piece)."""
        return max((state for state, stop in zip(self.state, self.stops) if state < len(stop)), default=0)


def _failure(stop: str) -> list[int]:
    """KMP's table: for each prefix of `stop`, the length of its longest proper prefix that is also its suffix."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class TextStream:
    """Tokens in, text pieces out: waits for whole UTF-8 characters, stops at a stop string
    (which is not returned) and holds back text that could be the start of one."""

    def __init__(self, tokenizer, stops: list[str], lock=None):
        self.tokenizer, self.stops = tokenizer, stops
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.tokens: list[int] = []
        self.sent = 0  # characters returned so far
        self.stopped = False
        self.matcher = StopMatcher(stops)
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
        hit = self.matcher.feed(text[self.matcher.read :])
        if hit is not None:
            self.stopped = True
            return self._take(text[:hit])
        return self._take(text[: len(text) - self.matcher.partial])

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


class Collector:
    """A request's text: pieces from `TextStream`, each handed to `emit` as it is ready."""

    def __init__(self, tokenizer, stops, lock, emit):
        self.inner = TextStream(tokenizer, stops, lock)
        self.emit, self.pieces = emit, []

    @property
    def stopped(self) -> bool:
        return self.inner.stopped

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, token: int) -> None:
        self._out(self.inner.push(token))

    def finish(self) -> None:
        self._out(self.inner.finish())

    def _out(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if self.emit is not None:
                self.emit(piece)
