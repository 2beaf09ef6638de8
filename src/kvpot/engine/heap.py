"""Keep the objects alive once an engine is ready out of the garbage collector's full passes (`gc.freeze`).

A process that loaded a model, compiled its step and captured its graphs holds hundreds of thousands of Python
objects (the model's modules and parameters, torch.compile's graphs and guards). CPython's full collection scans
every one of them: 160-220 ms on this project's CPU machine for the tiny model's process alone. It runs whenever
enough new objects outlive the younger generations, at whatever step that happens, and every decoding user waits
for it.

`freeze` collects once, then moves every object alive to the collector's permanent generation, so later full
passes scan only what was made since (vLLM's engine does the same after its capture). The cost: a frozen object
that later becomes garbage in a reference cycle is never collected until `thaw`. So freeze once the long-lived
objects are made (a server after its pools' capture, `kvpot.serve.service`; a bench row after its warm-up), and
thaw before dropping them (a bench row's end, a server's stop).
"""

from __future__ import annotations

import gc


def freeze() -> int:
    """Collect, then keep every object alive now out of later collections; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector (they are collected again, cycles included, by the next full
    pass): before the objects frozen with an engine are dropped."""
    gc.unfreeze()
