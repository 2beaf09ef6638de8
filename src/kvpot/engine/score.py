"""`Engine.score_ids`: per-token losses of a text read with a method (perplexity over long inputs)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from kvpot.engine.results import ScoreResult, Stats, _Run
from kvpot.engine.sampling import _as_ids
from kvpot.errors import KvpotError
from kvpot.methods import Step
from kvpot.scoring import token_nll


class Scoring:
    """The scoring half of `kvpot.Engine` (a mixin: it uses the engine's forward and cache)."""

    @torch.no_grad()
    def score_ids(self, input_ids, chunk_size: int | None = None, progress: bool = False,
                  prompt_tokens: int | None = None) -> ScoreResult:
        """Per-token negative log-likelihood of `input_ids` read chunk by chunk with the method.

        `nll[t]` is `-log p(x[t+1] | what the method held when x[t] was read)`: the model reads
        the text as it would a context (same chunks, same evictions), and each token is scored
        from the forward that read the token before it. Perplexity = `exp(nll.mean())`.
        `chunk_size` overrides the method's prefill chunk.

        With `prompt_tokens=N`, only the first N tokens are read as a prompt; every later token is
        fed alone as a decoding step (teacher-forced generation), so methods that compress while
        decoding (D2O, H2O, TOVA, ...) do so exactly as in `generate`.
        """
        ids = _as_ids(input_ids, self.device, "input_ids")
        if ids.numel() < 2:
            raise KvpotError("scoring needs at least two tokens.")
        total = ids.numel()
        prompt = total if prompt_tokens is None else prompt_tokens
        if not isinstance(prompt, int) or isinstance(prompt, bool) or not 1 <= prompt <= total:
            raise KvpotError(f"prompt_tokens must be between 1 and the {total} tokens scored, got {prompt_tokens!r}.")
        run = _Run(self._new_cache(total), 0, Stats(context_tokens=prompt))
        self._begin(run.cache, None)
        nll = torch.empty(total - 1, dtype=torch.float32, device=self.device)
        self._reset_peak_memory()
        started, offset = self._clock(), 0
        with tqdm(total=total, unit="tok", desc="score", disable=not progress, leave=False) as bar:
            while offset < total:
                if offset < prompt:
                    size = (min(chunk_size, prompt - offset) if chunk_size
                            else self.method.next_chunk(run.cache, prompt - offset))
                    step = Step("context", size, prompt_end=offset + size == prompt)
                else:
                    if offset == prompt:
                        run.stats.prefill_seconds = self._clock() - started
                        started = self._clock()
                    size, step = 1, Step("decode", 1, segment_end=True)
                hidden = self._forward(run, ids[offset : offset + size], step)
                targets = ids[offset + 1 : offset + size + 1]
                losses = token_nll(self.head, hidden[: targets.numel()], targets)  # on the head's device
                nll[offset : offset + targets.numel()] = losses.to(nll.device)
                offset += size
                bar.update(size)
        if prompt == total:
            run.stats.prefill_seconds = self._clock() - started
        else:
            run.stats.decode_seconds = self._clock() - started
            run.stats.new_tokens = total - prompt
        state = self._finish_state(run)
        return ScoreResult(nll, state.stats)

