"""kvpot's engine: one model, one method, contexts read in chunks into a bounded cache.

One sequence at a time:
- `engine.py`: `Engine` (prefill, generate, probes); `text.py` its text face, `score.py` scoring;
- `decoding.py`: fixed-shape decoding steps captured as CUDA graphs; `sampling.py`: token picking;
- `results.py`: what runs hand back; `state_io.py`: prefilled states on disk.

Many sequences at once (continuous batching over bounded caches):
- `pool.py`: `SlotPool`, per-layer KV with a slot dimension (a slot is also an ordinary `PotCache`);
- `batch.py`: `BatchDecoder`, one forward appending a token to many slots (graphs per batch size);
- `evict.py`: per-token eviction for many slots at once;
- `requests.py`: `Request`, one sequence's life; `scheduler.py`: `Scheduler`, the step-driven loop that
  the server and the evaluation runner feed and drain; `offline.py`: lists of requests run to the end.
"""

from kvpot.engine.engine import Engine
from kvpot.engine.results import Result, ScoreResult, State, Stats
from kvpot.engine.sampling import _eos_ids  # noqa: F401 - kvpot.serve reads the model's EOS ids through here

__all__ = ["Engine", "Result", "ScoreResult", "State", "Stats"]
