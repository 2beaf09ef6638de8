"""Defaults that several layers share, stated once (the library's, the server's and the benchmarks' alike).

A module without imports: the command line reads it to print its defaults without loading torch.
"""

# Prompt tokens a batched step reads (`Scheduler(prefill_tokens=...)`, `kvpot serve --prefill-tokens`,
# `kvpot bench throughput --prefill-tokens`): on the `llama3-8b` shape a 2,048-token forward takes about 90 ms
# on an H200 (records/engine-core-h100/), what a user decoding beside it waits for at most per step.
PREFILL_TOKENS = 2048
