"""Row-wise projections' all-reduce as a one-shot read over symmetric memory, where a decoding step's is small.

Under tensor parallelism every layer ends two row-wise projections (o_proj, down_proj) with an all-reduce of
its activations: 8 KB a step for one `llama3-8b` sequence, 512 KB for 64 rows. NCCL's ring takes 19-25 us a
call for those in a captured graph on two H200s (`records/tp-h200x2/gemv/`), ~1.2 ms of a 5.6 ms TP=2 step.
A one-shot all-reduce copies the activation into a buffer every rank can read (PyTorch's symmetric memory) and
each rank sums every rank's copy itself: one kernel, no ring.

How it is installed, with transformers' public extension points only: a tensor-parallel style of kvpot's
(`OneShotRowwise`, transformers' `RowwiseParallel` with another inference all-reduce) registered in
transformers' `ParallelInterface`, and the model's `config.base_model_tp_plan` naming it for the row-wise
entries before `from_pretrained` shards the model (`one_shot_plan`). The style falls back to transformers'
own path (NCCL) for what it does not take: a DTensor or gradient path, a bias, a CPU (gloo), an activation
over `MAX_BYTES`, a compiled step (whose compiler would have to place the buffer), or a machine where the
symmetric buffer could not be made. Every test in it depends on shapes, dtypes and devices alone, so every
rank takes the same path at every call, as a collective requires. `KVPOT_TP_ONE_SHOT=0` turns it off.

The buffer is made once per process group and dtype, at the first small all-reduce of an uncaptured forward
(a collective: every rank reaches it at the same call; a step captured before that keeps NCCL's).
"""

from __future__ import annotations

import os
import warnings

import torch

STYLE = "kvpot_rowwise_one_shot"
MAX_BYTES = 1 << 20  # a 64-row llama3-70b step's activation (64 x 8,192 x bf16); larger ones go to NCCL
_BUFFERS: dict[tuple[str, torch.dtype], torch.Tensor | bool] = {}  # (group, dtype) -> its buffer (False: none)
CALLS = {"one_shot": 0}  # Python-side calls that took the one-shot path (captures count once): for tests


def enabled() -> bool:
    return os.environ.get("KVPOT_TP_ONE_SHOT", "1") != "0"


def one_shot_plan(config) -> bool:
    """Name kvpot's style for the row-wise entries of `config.base_model_tp_plan`, in place, where this
    transformers has the TP styles it extends; whether it did. (On a CPU the style is installed and always
    falls back: the tests run transformers' loader and forward through it.)"""
    if not (enabled() and _register()):
        return False
    plan = dict(config.base_model_tp_plan or {})
    if "rowwise" not in plan.values():
        return False
    config.base_model_tp_plan = {key: STYLE if style == "rowwise" else style for key, style in plan.items()}
    return True


def all_reduce(x: torch.Tensor, group) -> torch.Tensor | None:
    """`x` summed over `group`'s ranks by a one-shot all-reduce, or None where this path does not apply."""
    if x.nbytes > MAX_BYTES or not x.is_cuda or x.requires_grad or torch.compiler.is_compiling():
        return None
    key = (group.group_name, x.dtype)
    buffer = _BUFFERS.get(key)
    if buffer is None:
        if torch.cuda.is_current_stream_capturing():
            return None  # made at an uncaptured step only (a collective); this capture keeps NCCL's
        buffer = _BUFFERS[key] = _buffer(group, x.dtype, x.device)
    if buffer is False:
        return None
    CALLS["one_shot"] += 1
    # one buffer for every call: the kernel starts with a barrier of the ranks, so a rank writes its next
    # activation here only after a half-layer of its own work, long after the others have read this one
    staged = buffer[: x.numel()]
    staged.copy_(x.reshape(-1))
    return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group.group_name).view_as(x)


def _buffer(group, dtype: torch.dtype, device: torch.device):
    """The group's symmetric buffer of `dtype` (a collective: every rank reaches it at the same call), or False
    with a warning where it cannot be made (the style then keeps NCCL's all-reduce for good)."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        torch.ops.symm_mem.one_shot_all_reduce  # raises where this torch has no such operator
        symm_mem.enable_symm_mem_for_group(group.group_name)
        buffer = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group)
        return buffer
    except Exception as err:  # noqa: BLE001 - any failure leaves NCCL's all-reduce in place
        warnings.warn(f"tensor parallelism: no symmetric-memory buffer ({type(err).__name__}: {err}); the "
                      "row-wise projections' all-reduces stay NCCL's.", stacklevel=2)
        return False


def _register() -> bool:
    """Register `OneShotRowwise` in transformers' `ParallelInterface` (transformers >= 5.17's TP styles)."""
    try:
        from transformers.distributed.tensor_parallel import ParallelInterface, RowwiseParallel
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:
        return False
    if not hasattr(RowwiseParallel, "transform_output_post_forward"):
        return False
    if STYLE in ParallelInterface().valid_keys():
        return True

    class OneShotRowwise(RowwiseParallel):
        """transformers' row-wise style whose inference all-reduce of a small activation is one-shot."""

        def transform_output_post_forward(self, module, output, mesh):
            if (isinstance(module, torch.nn.Linear) and not isinstance(output, DTensor) and mesh.ndim == 1
                    and module._parameters.get("bias") is None):
                reduced = all_reduce(output, mesh.get_group())
                if reduced is not None:
                    return reduced
            return super().transform_output_post_forward(module, output, mesh)

    ParallelInterface.register(STYLE, OneShotRowwise(input_layouts=Shard(-1), output_layouts=Replicate()))
    return True
