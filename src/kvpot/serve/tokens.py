"""The server's tokenizers: copies that threads never share, and a cheap bound on a text's tokens.

A fast tokenizer refuses concurrent use ("Already borrowed"), and one long encode must not hold up
the others: requests encode on worker threads, each with a copy of its own borrowed from a small
pool, while the event loop decodes streamed tokens with a copy nobody else touches (no lock that
a long encode could hold).

A text longer than `--max-context-tokens` times the most characters one token covers is refused
before it is tokenized: tokenizing a text costs time and memory in proportion to it (a 5 MB text
took 10 s and 1.4 GB), and the bound makes that refusal exact (no text it refuses could fit).
"""

from __future__ import annotations

import contextlib
import copy
import threading


class TokenizerPool:
    """Up to `size` copies of `tokenizer`, each used by one thread at a time."""

    def __init__(self, tokenizer, size: int = 4):
        self.tokenizer, self.size = tokenizer, size
        self.free = [tokenizer]
        self.made = 1
        self.ready = threading.Condition()

    @contextlib.contextmanager
    def borrow(self):
        with self.ready:
            while not self.free and self.made >= self.size:
                self.ready.wait()
            if self.free:
                tok = self.free.pop()
            else:
                self.made += 1
                tok = None
        if tok is None:
            tok = copy.deepcopy(self.tokenizer)  # outside the lock: others may borrow meanwhile
        try:
            yield tok
        finally:
            with self.ready:
                self.free.append(tok)
                self.ready.notify()


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for: its longest vocabulary entry (byte-level
    vocabularies spell a byte as one character, so this bounds characters too; special tokens count)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1
