from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Setup, Step, check_policy, check_positive
from kvpot.methods.token_scores import store_append, store_batch, store_forward
from kvpot.models.parallel import all_heads

NUC = "nuc"
SHARE = ("none", "layer", "model")  # which entries rank together: per KV head (Code 1), per layer, whole model
CATALYST = "infinipot.catalyst"  # key of the tokenized catalyst in cache.method_state

# Table 2's CaP-G, the paper's generic catalyst for instruction-tuned models.
GENERIC_CATALYST = "Summarize the critical points highlighted in this section."
# A model can name its own generic catalyst in its config (kvpot's reference model does: its
# `recall` instruction); this is read from the config's content, never from the model's name.
CONFIG_CATALYST_KEY = "kvpot_generic_catalyst"


@dataclass
class InfiniPot(Method):
    """Continual Context Distillation in a fixed memory pot (Kim et al., EMNLP 2024).

    The pot (Sec. 3.1-3.2) holds at most `pot_size` (|M|) KV entries per layer and KV head,
    counting cached entries, the chunk being encoded and the catalyst tokens together. The input
    is read in chunks that exactly fill the pot less the catalyst's room; when it is full, the pot
    is distilled to `compress_size` (|C|, default |M|/2) and filling continues, during decoding too.

    Distillation scores every entry two ways:
    - **CaP** (Sec. 3.3.1, eq. 2): the catalyst prompt is run over the pot through the engine's
      probe; an entry's representativeness is the attention the catalyst's queries pay it, summed
      over those queries, per KV head (the query heads of a group averaged). The catalyst's own
      entries are rolled back, so they are never kept. `catalyst="generic"` is the model's generic
      prompt (its config's `kvpot_generic_catalyst`, else Table 2's CaP-G "Summarize the critical
      points highlighted in this section."), `"question"` the user's question (CaP-Q), any other
      string is used verbatim, `None` disables CaP.
    - **NuC** (Sec. 3.3.2, eq. 4): `-log p(x_t | what the pot held when x_t was encoded)`, from the
      logits of the forward that encoded it (its first token from the previous forward's last
      logits), computed in slices (`kvpot.scoring.token_nll`). Kept entries keep the score they
      got when encoded: kvpot reads eq. 4's second case, `-log p(c_t | c_{0:t-1})` for the
      compressed region, as the score c_t already carries, since Code 1 computes token losses
      only from the current forward's logits and re-scoring kept tokens would need a second pass.

    Selection (Sec. 3.3.3, Code 1): the top `round(nuc_ratio*|C|)` entries by NuC are kept first
    (Code 1 lifts them above every CaP score), then each KV head is filled to |C| by CaP score.
    NuC is a per-token score, so on the first distillation the NuC picks are the same tokens in
    every head; later each head ranks the NuC scores of the entries it holds. Without CaP the
    rest of |C| is the most recent entries; with neither CaP nor NuC the pot keeps the most recent
    |C| (the paper's "merely fills the pot sequentially" ablation).

    Positions (Sec. 3.5): `reset` (CR-RoPE) gives the kept entries 0..|C|-1 in original order
    after each distillation, new tokens continuing from there; `absolute` is the "w/o Re-RoPE"
    ablation.

    `share` is kvpot's option, not the paper's: with per-head selection (`"none"`, Code 1) CR-RoPE
    numbers each head's own kept set, so one token takes different positions in different heads
    and layers. `"layer"` ranks the mean score of a layer's KV heads, so a layer's heads keep the
    same tokens; `"model"` ranks the mean over every layer too, so every head of every layer keeps
    the same tokens and each kept token has one position in the whole model. (NuC alone does the
    same; the paper's Table 3 attributes NuC alone's lower LongBench score to lost per-head diversity.)

    Bound: `pot_size` entries per layer and KV head, at every instant of prefill and decoding.
    """

    name = "infinipot"
    paper = "Kim et al. 2024, InfiniPot: Infinite Context Processing on Memory-Constrained LLMs"
    bound = "pot_size (cache + chunk + catalyst)"
    needs_token_nll = True
    batch_scores = (NUC,)  # written by `batch_append` (store_batch) at every new entry
    token_score = NUC  # and by `after_forward` (store_forward) after each forward
    # the pot distills when full, wherever forwards end; a token's NuC uses the logits before it either way
    chunk_dependent = False
    evicts_while_decoding = True  # the pot distills whenever it fills, during decoding too
    merges = False
    grows = False
    copies_document = "when_full"  # at the step its pot fills and distils (fed question or decoding)
    feeds_question = True  # its question appends, or fills the pot as a decoded token would
    pot_size: int = 2048
    compress_size: int | None = None
    nuc_ratio: float = 0.5
    catalyst: str | None = "generic"
    positions: str = "reset"
    share: str = "none"

    def __post_init__(self):
        check_positive(self, "pot_size")
        if self.compress_size is None:
            self.compress_size = self.pot_size // 2
        check_positive(self, "compress_size")
        if self.compress_size >= self.pot_size:
            raise KvpotError(
                f"infinipot: compress_size ({self.compress_size}) must be smaller than pot_size ({self.pot_size})."
            )
        if not 0.0 <= float(self.nuc_ratio) <= 1.0:
            raise KvpotError(f"infinipot: nuc_ratio must be in [0, 1], got {self.nuc_ratio!r}.")
        if self.catalyst is not None and not isinstance(self.catalyst, str):
            raise KvpotError("infinipot: catalyst must be 'generic', 'question', a prompt string, or None.")
        if self.catalyst in ("", "none", "None"):
            self.catalyst = None
        check_policy(self, ("reset", "absolute"))
        if self.share not in SHARE:
            raise KvpotError(f"infinipot: share must be one of {SHARE}, got {self.share!r}.")

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> InfiniPot:
        if budget < 2:
            raise KvpotError(f"infinipot: a pot of {budget} entries cannot be distilled; use a budget >= 2.")
        return cls(pot_size=budget, **overrides)

    def max_entries(self) -> int:
        return self.pot_size

    def prefill_chunk(self) -> int:
        return self.pot_size - self.compress_size

    # ------------------------------------------------------------------ run setup
    def begin(self, cache, setup: Setup) -> None:
        no_question = setup.question_ids is None or setup.question_ids.numel() == 0
        if self.catalyst == "question" and no_question and cache.method_state.get(CATALYST) is not None:
            return  # resuming a state prefilled with its question: the pot keeps distilling with that catalyst
        ids = self._catalyst_ids(setup)
        room = self.pot_size - self.compress_size - (0 if ids is None else ids.numel())
        if room <= 0:
            raise KvpotError(
                f"infinipot: the pot ({self.pot_size}) cannot hold the compressed entries ({self.compress_size}) "
                f"plus the {ids.numel()}-token catalyst and any new token; use a larger pot_size or a shorter catalyst."
            )
        cache.method_state[CATALYST] = ids

    def _catalyst_ids(self, setup: Setup) -> torch.Tensor | None:
        if self.catalyst is None:
            return None
        if self.catalyst == "question":
            if setup.question_ids is None or setup.question_ids.numel() == 0:
                raise KvpotError(
                    "infinipot: catalyst='question' needs the question while the context is read; "
                    "pass it with the context (generate(context, question)) or use catalyst='generic'."
                )
            return setup.question_ids
        return text_prompt_ids(self.catalyst, setup,
                               "infinipot: a text catalyst needs a tokenizer; use catalyst='question' or None.")

    # ------------------------------------------------------------------ the pot
    def _catalyst_len(self, cache) -> int:
        ids = cache.method_state.get(CATALYST)
        return 0 if ids is None else ids.numel()

    def _filled(self, cache) -> int:
        return max(cache.lengths())

    def next_chunk(self, cache, remaining: int) -> int:
        room = self.pot_size - self._catalyst_len(cache) - self._filled(cache)
        return min(remaining, room)

    def decode_plan(self, cache) -> str:
        # the step that fills the pot carries the catalyst and distills: it reshapes the cache
        full = self._filled(cache) + 1 + self._catalyst_len(cache) >= self.pot_size
        return "eager" if full else "append"

    def chunk_appends(self, cache, tokens: int) -> bool:
        return self._filled(cache) + tokens + self._catalyst_len(cache) < self.pot_size  # no probe, no distillation

    def decode_append(self, cache, step: Step) -> None:
        store_append(cache, NUC, step)

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        store_batch(layers, NUC, rows, index, step)

    def after_forward(self, cache, step: Step) -> bool:
        store_forward(cache, NUC, step)
        if self._filled(cache) + self._catalyst_len(cache) < self.pot_size:
            return False
        self.distill(cache, step)
        return True

    def tail_probe(self, cache, step: Step):
        """The catalyst rides in the forward that fills the pot (Sec. 3.3.1: it is appended to the
        pot right before it overflows), so CaP costs no second pass over the weights."""
        catalyst = cache.method_state.get(CATALYST)
        if catalyst is None or self._filled(cache) + step.n_new + catalyst.numel() < self.pot_size:
            return None
        return catalyst, AttentionRequest(rows=(-catalyst.numel(), None), row_reduce="sum", head_reduce="mean")

    def distill(self, cache, step: Step) -> None:
        """Shrink every layer to |C| (Code 1), scoring with the catalyst probe and NuC."""
        catalyst = cache.method_state.get(CATALYST)
        cap = step.tail_observation
        if cap is None and catalyst is not None:  # the pot filled without a forward that carried it
            cap = step.probe(catalyst, AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean"))
        nuc_slots = round(float(self.nuc_ratio) * self.compress_size)
        layers = cache.layers
        if self.share == "none" and _alike(layers):
            # every layer ranked in one call: Code 1 ranks each head of each layer alone, which `select` does over
            # any leading dims, so [layers, b, kv_heads, n] gives the same picks; one launch of each op for the
            # model instead of one a layer (~4.4 ms less device time a distillation on an 8B shape, an H200:
            # records/engine-core-h200/packed-4/)
            nucs = torch.stack([layer.score(NUC) for layer in layers])
            keep = select(None if cap is None else torch.stack(list(cap)), nucs, self.compress_size, nuc_slots)
            for layer, kept in zip(layers, keep):
                layer.select(kept)
            return
        groups = [range(len(layers))] if self.share == "model" else [[i] for i in range(len(layers))]
        for group in groups:  # the layers that keep one set of tokens (each alone unless share="model")
            caps = None if cap is None else [cap[i] for i in group]
            nucs = [layers[i].score(NUC) for i in group]
            if self.share == "none":
                # [b, kv_heads, |C|]
                keep = select(None if caps is None else caps[0], nucs[0], self.compress_size, nuc_slots)
            else:
                # [b, 1, |C|]: every head alike, so every rank's heads (tensor parallelism) are scored together
                parallel = layers[0].parallel
                keep = select_shared(None if caps is None else [all_heads(parallel, c) for c in caps],
                                     [all_heads(parallel, n) for n in nucs], self.compress_size, nuc_slots)
            for i in group:
                layers[i].select(keep.to(layers[i].device))


def _alike(layers) -> bool:
    """Whether the layers' entries can be ranked in one call: one device, one count (a model split over GPUs ranks
    each layer where it lives)."""
    return len({layer.device for layer in layers}) == 1 and len({layer.n for layer in layers}) == 1


def text_prompt_ids(text: str, setup: Setup, no_tokenizer: str) -> torch.Tensor:
    """A method's prompt text as token ids [m]. "generic" is the model's generic prompt: its
    config's `kvpot_generic_catalyst` if it names one, else Table 2's CaP-G. `no_tokenizer` is the
    error raised when the engine has no tokenizer."""
    if text == "generic":
        text = getattr(setup.config, CONFIG_CATALYST_KEY, None) or GENERIC_CATALYST
    if setup.tokenizer is None:
        raise KvpotError(no_tokenizer)
    ids = setup.tokenizer.encode(text, add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long, device=setup.device)


def select(cap: torch.Tensor | None, nuc: torch.Tensor, keep: int, nuc_slots: int) -> torch.Tensor:
    """Indices [b, kv_heads, keep] (ascending) that Code 1 keeps.

    cap: [b, kv_heads, n] CaP scores or None; nuc: [b, kv_heads, n] NuC scores. The top
    `nuc_slots` entries by NuC are kept first; the remaining slots go to the best CaP scores (or,
    without CaP, to the most recent entries).
    """
    n = nuc.shape[-1]
    base = cap if cap is not None else torch.arange(n, device=nuc.device, dtype=torch.float32).expand_as(nuc)
    scores = base.clone()
    if nuc_slots > 0:
        top_nuc = nuc.topk(min(nuc_slots, n), dim=-1).indices
        scores.scatter_(-1, top_nuc, float("inf"))  # Code 1, line 10: above every CaP score
    return scores.topk(keep, dim=-1).indices.sort(dim=-1).values


def select_shared(caps: list[torch.Tensor] | None, nucs: list[torch.Tensor], keep: int, nuc_slots: int) -> torch.Tensor:
    """Indices [b, 1, keep] (ascending) kept by every KV head of the given layers (`share`).

    caps, nucs: one [b, kv_heads, n] tensor per layer, over the same n tokens in every head (true
    when the heads have always selected together). The scores are averaged over heads and layers
    (CaP is each head's attention summed over the catalyst's rows, so heads and layers weigh alike),
    then ranked as `select` ranks one head's.
    """
    device = nucs[0].device  # a model split over GPUs: rank on the first layer's device
    nuc = torch.stack([t.to(device).float().mean(dim=1, keepdim=True) for t in nucs]).mean(dim=0)
    cap = None if caps is None else torch.stack([t.to(device).float().mean(dim=1, keepdim=True) for t in caps]).mean(dim=0)
    return select(cap, nuc, keep, nuc_slots)

