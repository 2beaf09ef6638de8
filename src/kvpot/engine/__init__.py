"""kvpot's engine: one model, one method, contexts read in chunks into a bounded cache.

- `engine.py`: `Engine`, one sequence at a time (prefill, generate, probes, scoring);
- `batch.py`: `BatchEngine`, many sequences at once over a slot pool (`pool.py`), driven step by
  step by a `Scheduler` (`scheduler.py`) that the server and the evaluation runner feed and drain;
- `decoding.py`: fixed-shape decoding steps captured as CUDA graphs; `sampling.py`: token picking;
- `results.py`: what runs hand back; `state_io.py`: prefilled states on disk.
"""

from kvpot.engine.engine import Engine
from kvpot.engine.results import Result, ScoreResult, State, Stats
from kvpot.engine.sampling import _eos_ids  # noqa: F401 - kvpot.serve reads the model's EOS ids through here

__all__ = ["Engine", "Result", "ScoreResult", "State", "Stats"]
