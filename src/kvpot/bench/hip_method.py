"""hip-attn 1.2.9's attention as a kvpot method, for accuracy beside kvpot's InfiniteHiP (issue 46).

kvpot's InfiniteHiP replaces dense attention for a whole forward through `PotCache.attention`, the hook its
engine calls with un-rotated queries and keys (`positions="hip"`); `HipAttn` puts hip-attn's
`dual_stage_quadratic_hip_attention` behind that same hook, so both read the same samples through the same
chunked prefill and the same cache, and only the attention differs. Decoding runs eagerly (hip-attn's kernels are
not captured in kvpot's graphs) with hip-attn's mask refresh (`HiPMaskRefreshState`'s schedule, the caller's
`cached_metadata`). `case` names the configuration (`kvpot.bench.hip_mapping.CASES`); layers below
`early_layers` are hip-attn's dense layers. Not in `kvpot.methods.METHODS`: `register()` adds it for a run that has
hip-attn installed (benchmarks/hip-reference-h100/accuracy.py).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from kvpot.bench.hip_inputs import Inputs
from kvpot.bench.hip_mapping import get_case
from kvpot.bench.hip_reference import HipDecoder, _bthd, hip_args, hip_query
from kvpot.errors import KvpotError
from kvpot.methods.infinitehip import InfiniteHiP




def hip_decode_rows() -> int:
    """Below this many query rows hip-attn 1.2.9's block-sparse attention runs its decoding kernel unless told not
    to (its `get_block_sparse_backend`, with its own environment switch)."""
    return int(os.getenv("HIP_FLASHDECODE_THRESH", "32"))


class HipAttnRuntime:
    """What `PotCache.attention` calls: hip-attn's attention for each layer, one mask-refresh state per layer."""

    def __init__(self, hip, case, rope, max_positions: int, early_layers: int, num_layers: int):
        self.hip, self.case, self.rope, self.max_positions = hip, case, rope, max_positions
        self.early_layers, self.decoding, self.step = early_layers, False, 0
        self.decoders: list[HipDecoder | None] = [None] * num_layers

    def clone(self) -> HipAttnRuntime:
        return HipAttnRuntime(self.hip, self.case, self.rope, self.max_positions, self.early_layers, len(self.decoders))

    def restart(self) -> None:
        self.step, self.decoders = 0, [None] * len(self.decoders)

    def __call__(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """query [1, heads, q, d] un-rotated, key/value [1, kv_heads, n, d] (keys un-rotated) -> [1, heads, q, d]."""
        if query.shape[0] != 1:
            raise KvpotError("hipattn runs one sequence at a time (batch 1).")
        index, n, q = layer.layer_idx, key.shape[2], query.shape[2]
        early = index < self.early_layers
        inputs = Inputs(query[0], key[0], value[0], self.rope, scaling, self.max_positions, "model")
        # (hip-attn's kernels launch on the current CUDA device; on a CPU they run under Triton's interpreter)
        with torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext():
            if self.decoding and q == 1:
                if self.decoders[index] is None:
                    self.decoders[index] = HipDecoder(self.hip, self.case, inputs, early, True)
                decoder = self.decoders[index]
                decoder.inputs = inputs
                out, _ = decoder(self.step, query[0], n)
                return out.unsqueeze(0)
            positions = torch.arange(n - q, n, device=query.device)
            scaled = hip_query(query[0], scaling)
            if q >= hip_decode_rows() or os.environ.get("HIP_DISABLE_FLASHDECODE", "0") == "1":
                args = hip_args(self.hip, self.case, inputs, early, positions, False)
                out, _ = self.hip.attention(_bthd(scaled), _bthd(key[0]), _bthd(value[0]), args)
            else:
                out = self._few_rows(inputs, early, scaled, positions, n)
            return out[0].transpose(0, 1).unsqueeze(0)

    def _few_rows(self, inputs: Inputs, early: bool, scaled: torch.Tensor, positions: torch.Tensor, n: int):
        """A forward of fewer than `hip_decode_rows()` queries (a short question). hip-attn would run its decoding
        kernel on them, which reads a paged cache only ("decode should not accept k") and, with its default splits,
        weighs some sparse blocks more than once (`HipDecoder`, benchmarks/hip-reference-h100/interpret.py). The
        chunk goes to its prefill kernel instead (`disable_flashdecode`, hip-attn's own switch), with the plain
        keys the longer chunks get; a lone query is doubled as the masking query (`HipDecoder`: its single-row scan
        kernel does not compile)."""
        mask, at = (scaled, positions) if scaled.shape[1] > 1 else (torch.cat([scaled, scaled], 1), positions.repeat(2))
        args = hip_args(self.hip, self.case, inputs, early, at, False, q_mask=_bthd(mask), disable_flashdecode=True)
        out, _ = self.hip.attention(_bthd(scaled), _bthd(inputs.keys), _bthd(inputs.values), args)
        return out


@dataclass
class HipAttn(InfiniteHiP):
    """hip-attn's attention (the authors' kernels) inside kvpot's engine; `case`: paper, hip-args or hip-config."""

    name = "hipattn"
    paper = "Lee et al. 2025 (InfiniteHiP), the authors' hip-attn 1.2.9"
    case: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        get_case(self.case)

    def begin(self, cache, setup) -> None:
        from kvpot.bench.hip_shim import load_hip

        layers = len(cache.layers)
        max_positions = getattr(setup.config, "max_position_embeddings", None) or 131072
        early = 4 if self.case == "hip-config" else self.early_layers  # HiPAttentionConfig.dense_layers
        cache.attention = HipAttnRuntime(load_hip(), get_case(self.case), cache.rope, max_positions, early, layers)
        cache.host_storage = False

    def before_forward(self, cache, step) -> None:
        runtime = cache.attention
        runtime.decoding = step.phase == "decode"
        if not runtime.decoding:
            runtime.restart()

    def decode_plan(self, cache) -> str:
        return "eager"  # hip-attn's launches are not captured in kvpot's CUDA graphs

    def decode_key(self, cache) -> tuple:
        return ()  # eager decoding: no graph to key

    def after_forward(self, cache, step) -> bool:
        if step.phase == "decode":
            cache.attention.step += 1
        return False

    def report(self, cache) -> dict | None:
        return None


def register() -> None:
    """Make `hipattn` a method name for this process (kvpot eval --method hipattn:case=paper)."""
    from kvpot.methods import METHODS

    METHODS[HipAttn.name] = HipAttn
