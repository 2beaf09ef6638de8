"""Defaults that several layers share, stated once (the library's, the server's and the benchmarks' alike).

A module without imports: the command line reads it to print its defaults without loading torch.
"""

# Prompt tokens a batched step reads (`Scheduler(prefill_tokens=...)`, `kvpot serve --prefill-tokens`,
# `kvpot bench throughput --prefill-tokens`): what a user decoding beside a prompt waits for, at most, per step. On
# the `llama3-8b` shape on an H200, 48 fresh prompts at 1 request/s (the same commit, one call): 1,024 gave ITL p99
# 161.5 ms and TTFT p50 2.80 s against 176.0 ms and 3.33 s at 2,048 (records/engine-core-h200/packed/); with chunks
# cut to fill a step, 1,024 gave 68.4 ms and 2.51 s, 768 61.8 ms and 3.81 s (records/engine-core-h200/packed-2/).
PREFILL_TOKENS = 1024

# Whether a batched step reads its prompt chunks in the decoding rows' forward (`Scheduler(mix=...)`,
# `kvpot serve --mix`, `kvpot bench throughput --mix`). "auto": where the varlen Triton kernel attends the
# chunks over their pool slots (`kvpot.engine.mixed.resolve_mix`). On an H100 with it (records/engine-core-h100/
# varlen/, 48 fresh prompts at 1 request/s) the mixed step matched or beat prompts read apart at both budgets
# measured: ITL p99 192 against 369 ms at 2,048 prompt tokens a step, 194 against 415 ms at 1,024.
MIX = "auto"
# Which runner decodes one sequence (`Engine(runner=...)`, `kvpot generate --runner`, `kvpot bench decode --runner`):
# "core", a request in a scheduler of one slot (`kvpot.engine.one_slot`, issue 43's one decode machine), or "sequence",
# the one-sequence `Decoder`. "auto": the core wherever it takes the sequence (fixed-shape steps on one device, one
# process, a cache on the device), else `Decoder` or the eager loop (`one_slot.core_decodes`).
# "auto" is the default: every method steps through the core at 0.97-1.01x `Decoder`'s step after 32K on an H100
# (records/engine-core-h100/sequence-steps/; the steady methods as one-sequence steps: auto-default/).
RUNNER = "auto"
MIXES = ("auto", "on", "off", "eager")  # its values (and True / False in the library); eager: on, never captured

# Which prompt a batched step reads first (`Scheduler(prompt_order=...)`, `kvpot serve --prompt-order`, `kvpot bench
# throughput --prompt-order`): "shortest" (the fewest prompt tokens left, then the oldest) or "arrival" (the oldest: no
# younger request passes an older one). So that shorter prompts that keep arriving cannot hold a long one back for good,
# with "shortest" a prompt whose request took its slot more than PROMPT_PATIENCE seconds ago is read before the shorter
# ones (by arrival among such; `Scheduler(prompt_patience=...)`, `--prompt-patience`: 0 reads in arrival order, inf
# never lets one overtake). On an H100, 48 fresh prompts of 2K-32K at 1 request/s, the `llama3-8b` shape, the same
# commit and machine: shortest first with 4 s gave TTFT p50 / p95 1.35 / 9.37 and 1.38 / 9.36 s (two runs), 5 s
# 1.38 / 9.71 s, arrival order 2.09 / 9.54 s, with ITL p99 53.7-54.3 ms in all four
# (records/engine-core-h100/prompt-order/). The median falls by a third and the tail does not grow: the default. With
# 10 s the longest prompts waited longer (an H200: 1.19 / 11.23 s; records/engine-core-h200/packed-4/). The plan then
# reads a clock (the step composition, so bf16 tokens outside batch-invariant decoding, can differ between runs of
# the same job); arrival order, or shortest with an infinite patience, plans from the requests alone (below).
PROMPT_ORDER = "shortest"
PROMPT_ORDERS = ("arrival", "shortest")
PROMPT_PATIENCE = 4.0
# Offline jobs (`Engine.generate_batch`, `kvpot eval --batch-size`, lm-eval's `batch_size`) submit a group at once and
# wait for all of it, so no time to first token is at stake, while an evaluation's answers should come out the same
# on every run: they plan in arrival order, from the requests alone.
OFFLINE_PROMPT_ORDER = "arrival"

# Whether a decode-only batched step is launched before the previous step's tokens are handed over
# (`Scheduler(launch_ahead=...)`, `kvpot serve --launch-ahead`, `kvpot bench throughput --launch-ahead`;
# `kvpot.engine.ahead`): the hand-over waits for the device, so otherwise the device idles while the host plans and
# launches the next step (the copy path's compiled 64-reader step: 16.6 ms of device work, 17.27 ms a step on an
# H100, records/engine-core-h100/decode-tuning/). Off and on in one call on an H100: 64 readers of a stored 128K
# document (a copy each, compiled) ITL p50 17.43 -> 16.93 ms, a batch of one 8.10 -> 8.02 ms
# (records/engine-core-h100/launch-ahead/). "auto": on a CUDA device, not under tensor parallelism; "on"; "off".
LAUNCH_AHEAD = "auto"
LAUNCH_AHEADS = ("auto", "on", "off")

# How a question asked of a stored document is read in a batched step (`Scheduler(feed_questions=...)`, `kvpot serve
# --feed-questions`, `kvpot bench throughput --feed-questions`), for methods whose cache does not depend on how the
# question is cut (`Method.feeds_question`): "auto" reads it as one chunk of the mixed forward where prompts mix (a GPU),
# else feeds it one token per decoding step while others run or wait (alone, one forward of its own answers sooner);
# "always" feeds it; "never" reads it in its own chunks. On an H100, 64 readers of a stored 128K document (a copy each,
# compiled, one call): fed, their 32-token questions took 32 of 288 steps, TTFT p50 0.64 s, 3,374 tok/s; as chunks,
# 8 mixed steps, 0.19 s, 3,665 tok/s, the decode step 16.47 ms either way (records/engine-core-h100/evict-inside/).
FEED_QUESTIONS = "auto"
FEED_QUESTIONS_CHOICES = ("auto", "always", "never")

# Share of the GPU memory free after loading that a batched pool sized by itself takes
# (`Scheduler(memory_fraction=...)`): the rest is for a step's activations and the logits. `kvpot serve` gives
# its default method's pool less (`--kv-memory-fraction`, 0.7): other methods' pools and stored states share it.
SLOT_MEMORY_FRACTION = 0.85

# A pool of a size the caller gave must fit in this share of the free GPU memory (`kvpot.engine.slot_sizes.slot_count`,
# the one check for the library and the server), else the pool is refused before it is allocated.
GIVEN_SLOTS_MEMORY_FRACTION = 0.9

# Entries in each split of the decode attention under batch-invariant decoding (`Engine(batch_invariant=True)`):
# a fixed size, so a row's sums never depend on the batch or on its slot's capacity (kvpot.kernels.decode). A
# multiple of the kernel's 64-entry loop step; 512 keeps a 4,096-entry pot in 8 splits a KV head.
SPLIT_ENTRIES = 512
