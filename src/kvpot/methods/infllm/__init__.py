"""InfLLM (Xiao et al. 2024): block memory with representative tokens over a sliding window.

`method` holds the dataclass and its engine hooks, `memory` the representative scores, unit summaries
and lookup, `attend` the two-part attention of a chunk, `decode` the fixed-shape step, `runtime` the
attention a `PotCache` runs; the Triton step is `kvpot.kernels.infllm`.
"""

from kvpot.methods.infllm.method import InfLLM

__all__ = ["InfLLM"]
