"""The stand-in kvpress package the eval tests run `--baseline kvpress` against (no kvpress needed)."""

import textwrap
from pathlib import Path

STAND_IN = '''
"""Stand-in for kvpress in kvpot's eval tests: kvpress' press names and protocol, simplest pruning; sleeps
$STAND_IN_SLEEP s per prefill (a slow press, for the time-limit tests)."""
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

from kvpot.compat import cache_from_kwargs

__version__ = "0.0-eval-test"


@dataclass
class _Press:
    compression_ratio: float = 0.0
    last: bool = False

    def hook(self, module, args, kwargs, output):
        cache, q_len = cache_from_kwargs(kwargs), kwargs["hidden_states"].shape[1]
        layer = cache.layers[module.layer_idx]
        n = layer.keys.shape[2]
        if n != q_len:  # only the prefill forward (the cache holds just its tokens)
            return output
        if module.layer_idx == 0:
            time.sleep(float(os.environ.get("STAND_IN_SLEEP", "0")))
        kept = int(n * (1 - self.compression_ratio))  # kvpress' n_kept
        part = slice(n - kept, n) if self.last else slice(0, kept)
        layer.keys, layer.values = layer.keys[:, :, part].contiguous(), layer.values[:, :, part].contiguous()
        return output

    @contextmanager
    def __call__(self, model):
        hooks = [layer.self_attn.register_forward_hook(self.hook, with_kwargs=True) for layer in model.model.layers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


@dataclass
class SnapKVPress(_Press):
    window_size: int = 64


@dataclass
class TOVAPress(_Press):
    last: bool = True


@dataclass
class KnormPress(_Press):
    def hook(self, module, args, kwargs, output):
        raise RuntimeError("stand-in failure")
'''


def write_stand_in(site: Path) -> Path:
    """A folder holding the stand-in `kvpress` package (what `--kvpress-path` names)."""
    (site / "kvpress").mkdir(parents=True)
    (site / "kvpress" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    return site
