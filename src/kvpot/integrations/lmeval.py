"""kvpot as a model of EleutherAI's lm-evaluation-harness (``pip install "kvpot[lmeval]"``).

Every request reads its context with a kvpot method, in the method's bounded memory:

* ``generate_until`` -- the prompt is read as a context, then the answer is generated greedily
  (``Engine.generate_ids``) and cut at the first ``until`` string;
* ``loglikelihood`` -- the context is read as a prompt and the continuation is fed token by token
  as decoding steps (``Engine.score_ids(..., prompt_tokens=len(context))``), so each continuation
  token is scored from what the method kept; ``is_greedy`` compares the continuation with a greedy
  generation of the same length after the same reading;
* ``loglikelihood_rolling`` -- the whole text is read as one context (as ``kvpot eval
  perplexity`` does) and every token is scored once: no windows, the method bounds the memory.

lm-eval finds models in its own registry, which it fills from its own package only, so this
module must be imported first. Run the harness through it::

    python -m kvpot.integrations.lmeval --model kvpot \\
        --model_args pretrained=PATH,method=infinipot:pot_size=4096 --tasks TASKS

(any ``lm_eval`` arguments work), or from Python: ``import kvpot.integrations.lmeval`` and then
``lm_eval.simple_evaluate(model="kvpot", model_args=...)``. Model arguments: ``pretrained``
(default: the bundled reference model), ``method`` (a kvpot method spec ``name:key=value``),
``budget``, ``device``, ``dtype`` (auto, float32, bfloat16, float16), ``greedy_check`` (default
true; false skips the extra generation of ``is_greedy``), ``batch_invariant`` (default false; true: batch-invariant
decoding, so ``batch_size`` N generates what 1 does in bf16 too), and any other ``key=value``: a method
parameter (lm-eval splits ``--model_args`` at commas, so ``method=streaming:sinks=4,window=1020``
arrives as ``method=streaming:sinks=4`` and ``window=1020``; both reach the method).
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  (fills the registry first: get_model only does so while it is empty)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from kvpot.errors import KvpotError

DTYPES = ("auto", "float32", "bfloat16", "float16")


@register_model("kvpot")
class KvpotLM(LM):
    """An lm-eval model that reads every context with a kvpot method (see the module docstring)."""

    def __init__(
        self,
        pretrained: str | None = None,
        method: str = "full",
        budget: int | None = None,
        device: str | None = None,
        dtype: str = "auto",
        greedy_check: bool = True,
        batch_size: Any = 1,  # generate_until requests decode this many at a time (kvpot.engine.scheduler)
        max_batch_size: Any = None,
        batch_invariant: Any = False,  # Engine(batch_invariant=...): batched texts those of one at a time in bf16
        **method_params: Any,
    ) -> None:
        import torch

        from kvpot.engine import Engine
        from kvpot.eval.common import load_model, special_prefix
        from kvpot.methods.spec import MethodSpec, build_methods

        super().__init__()
        if dtype not in DTYPES:
            raise KvpotError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise KvpotError(f"budget must be an integer, got {budget!r}.")
        settings = {k: _text(v) for k, v in method_params.items()}
        (run,) = build_methods([MethodSpec.parse(str(method))], budget, settings)
        if device == "cuda" and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's own default is cuda; its HF model falls back the same way
        # None: the bundled reference model; device None: cuda if there is one
        model, tokenizer, path, device = load_model(None if pretrained is None else str(pretrained), device, dtype)
        self.pretrained, self.method_spec = path, run.spec.text()
        self.tokenizer = tokenizer
        if str(batch_invariant).lower() not in ("true", "false"):
            raise KvpotError(f"batch_invariant must be true or false, got {batch_invariant!r}.")
        self.engine = Engine(model, tokenizer, method=run.method, chat_template=False,
                             batch_invariant=str(batch_invariant).lower() == "true")
        self.greedy_check = bool(greedy_check)
        # lm-eval's "auto" sizes batches by trial; kvpot's slots are sized by the method's bound instead
        self.batch_size = int(max_batch_size or 64) if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size < 1:
            raise KvpotError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}.")
        self._device = torch.device(device)
        # What the tokenizer puts before text (BOS, or nothing), as lm-eval's HF model encodes contexts;
        # an empty context, and a rolling text, get lm-eval's prefix token instead: BOS, else EOS.
        self.prefix = special_prefix(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.start = self.prefix or ([eos] if eos is not None else [])

    # ------------------------------------------------------------------ helpers
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as lm-eval's HF model splits them (spaces go to the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self._encode(context + continuation)
        head = self._encode(context)
        context_ids = self.prefix + head if head else self.start
        if not context_ids:
            raise KvpotError("an empty context needs a BOS or EOS token, and this tokenizer has neither.")
        return context_ids, whole[len(head):]

    # ------------------------------------------------------------------ lm-eval API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in tqdm(requests, desc="kvpot loglikelihood", disable=disable_tqdm):
            context, continuation = request.args
            context_ids, target = self._pair(context, continuation)
            if not target:
                out.append((0.0, True))
                continue
            result = self.engine.score_ids(context_ids + target, prompt_tokens=len(context_ids))
            logprob = -float(result.nll[len(context_ids) - 1:].double().sum())
            greedy = False
            if self.greedy_check:
                generated = self.engine.generate_ids(context_ids, max_new_tokens=len(target), ignore_eos=True)
                greedy = list(generated.token_ids) == target
            out.append((logprob, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (logprob, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in tqdm(requests, desc="kvpot loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            ids = self.start + self._encode(text)
            if len(ids) < 2:
                out.append(0.0)
                continue
            logprob = -float(self.engine.score_ids(ids).nll.double().sum())
            out.append(logprob)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, logprob)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from kvpot.engine.offline import generate_many
        from kvpot.engine.requests import Request

        jobs = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if kwargs.pop("do_sample", False) else 0.0
            context_ids = (self.prefix + self._encode(context)) if context else self.start
            jobs.append((request, until, context_ids, max_new, temperature, kwargs.pop("seed", None)))
        if self.batch_size > 1:  # decoded together; the same greedy tokens as one at a time
            batch = [Request(ids, max_new_tokens=new, temperature=temp, seed=seed) for _, _, ids, new, temp, seed in jobs]
            generate_many(self.engine, batch, self.batch_size, progress=not disable_tqdm)
            failed = [r for r in batch if r.status == "failed"]
            if failed:
                raise KvpotError(f"a generate_until request failed in a batch: {failed[0].error}")
            tokens = [r.tokens for r in batch]
        else:
            tokens = [self.engine.generate_ids(ids, max_new_tokens=new, temperature=temp, seed=seed).token_ids
                      for _, _, ids, new, temp, seed in tqdm(jobs, desc="kvpot generate_until", disable=disable_tqdm)]
        out = []
        for (request, until, *_), token_ids in zip(jobs, tokens):
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise KvpotError(f"{self.pretrained!r} has no chat template; drop --apply_chat_template.")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")


def _text(value: Any) -> str:
    """lm-eval turns model args into Python values; kvpot's method settings take their text."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def main() -> None:
    """``python -m kvpot.integrations.lmeval``: lm-eval's own command line, with ``kvpot`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
