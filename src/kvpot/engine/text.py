"""The text half of `kvpot.Engine`: strings in, strings out (a mixin over the token-level engine).

`encode` places a context and a question as kvpress' pipeline does (one chat-templated user turn,
or BOS + context + question without a template); `prefill`, `generate` and `generate_batch` are the
token-level calls (`prefill_ids`, `generate_ids`, `kvpot.engine.offline`) on encoded text.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpot.defaults import MIX
from kvpot.engine.results import Result, State
from kvpot.engine.sampling import _TextStreamer
from kvpot.errors import KvpotError

# Marker used to split a chat-templated user turn into context and question parts.
_SPLIT = "\u241ekvpot-question\u241e"


class TextApi:
    """`Engine`'s text methods; they use its tokenizer, `prefill_ids` and `generate_ids`."""

    def encode(self, context: str | None, question: str | None, tokenizer=None) -> tuple[list[int], list[int]]:
        """Token ids of the context and the question, placed as kvpress' pipeline does.

        With a chat template, one user turn holds the context followed by the question; the
        context part ends where the question starts, and the question part carries the rest of
        the template (generation prompt included). Without one, the context gets the tokenizer's
        special tokens (BOS) and the question is appended verbatim. `tokenizer`: a copy of the engine's to
        encode with (a fast tokenizer refuses use from two threads at once).
        """
        tok = tokenizer if tokenizer is not None else self._require_tokenizer()
        if self.uses_chat_template():
            text = tok.apply_chat_template(
                [{"role": "user", "content": (context or "") + _SPLIT}], add_generation_prompt=True, tokenize=False
            )
            head, tail = text.split(_SPLIT)
            context_ids = tok.encode(head, add_special_tokens=False) if context is not None else []
            return context_ids, tok.encode((question or "") + tail, add_special_tokens=False)
        context_ids = tok.encode(context, add_special_tokens=True) if context is not None else []
        question_ids = tok.encode(question, add_special_tokens=False) if question else []
        return context_ids, question_ids

    def prefill(self, context: str, progress: bool = False, should_stop: Callable[[], bool] | None = None) -> State:
        """Read (and compress) `context` once; ask questions of it later with `generate(state=...)`.

        Methods that need the question while reading (InfiniPot with `catalyst="question"`) take
        `generate(context, question)` instead.
        """
        if not context:
            raise KvpotError("the context is empty; give some text to read.")
        context_ids, _ = self.encode(context, None)
        return self.prefill_ids(context_ids, progress=progress, should_stop=should_stop)

    def generate(
        self,
        context: str | None = None,
        question: str | None = None,
        max_new_tokens: int = 64,
        state: State | None = None,
        on_text: Callable[[str], None] | None = None,
        progress: bool = False,
        keep_state: bool = True,
        **sampling,
    ) -> Result:
        """Answer `question` about `context` (or about a prefilled `state`). Strings in, string out.

        `keep_state=False` decodes in the state's own cache instead of a copy (half the memory of a
        long context; the state cannot be asked again)."""
        if state is None and not context:
            raise KvpotError("the context is empty; give some text to read (or a prefilled state).")
        if state is not None and context:
            raise KvpotError("give either a context or a prefilled state, not both.")
        context_ids, question_ids = self.encode(context if state is None else None, question)
        printer = _TextStreamer(self.tokenizer, on_text) if on_text else None
        result = self.generate_ids(
            context_ids if state is None else None,
            question_ids,
            max_new_tokens=max_new_tokens,
            state=state,
            on_token=printer,
            progress=progress,
            keep_state=keep_state,
            **sampling,
        )
        if printer:
            printer.flush()
        return result

    def generate_batch(
        self,
        contexts: list[str] | None = None,
        questions: list[str | None] | None = None,
        max_new_tokens: int = 64,
        states: list[State] | None = None,
        progress: bool = False,
        batch_size: int | None = None,
        share_documents: bool = False,
        mix: bool | str = MIX,
        reader_room: int | None = None,
        **sampling,
    ) -> list[Result]:
        """Answer many prompts at once: each `contexts[i]` with `questions[i]` (or each prefilled
        `states[i]`), `batch_size` (default: all, at most 64) decoding together over a pool of bounded
        caches (continuous batching, `kvpot.engine.scheduler`). Results come back in order; each equals
        what `generate` gives the same prompt alone (greedy). `sampling`: temperature, top_p, seed,
        ignore_eos, as `generate`; a seeded request samples the same tokens whatever shares its batch.
        `share_documents`: requests asking the same `State` read its entries from one copy
        (`Scheduler(share_documents=True)`), the same tokens; `reader_room`: such readers hold tail slots of that many
        entries (`Scheduler(reader_room=...)`). `mix`: where prompt chunks are read
        (`Scheduler(mix=...)`: "auto", with the decoding rows on a GPU; "on"; "off"; "eager"), the same tokens."""
        from kvpot.engine.offline import generate_texts

        return generate_texts(self, contexts, questions, max_new_tokens, states, progress, batch_size,
                              share_documents=share_documents, mix=mix, reader_room=reader_room, **sampling)

    def uses_chat_template(self) -> bool:
        """Whether prompts go through the tokenizer's chat template (`chat_template`: auto, True or False)."""
        has = bool(getattr(self.tokenizer, "chat_template", None))
        if self.chat_template is True and not has:
            raise KvpotError("chat_template=True, but this tokenizer has no chat template.")
        return has and self.chat_template in (True, "auto")

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise KvpotError("this engine has no tokenizer; use generate_ids/prefill_ids with token ids.")
        return self.tokenizer
