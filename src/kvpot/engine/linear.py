"""Single-token steps' linear layers through kvpot's matrix-vector kernel (`Engine(linear="gemv")`).

A decoding step at batch 1 multiplies every weight by one row; `kvpot.kernels.gemv` reads the weights
at the memory's speed where cuBLAS' general kernels do not (issue 30). The model's modules are left as
they are: while a single-token step runs, a `TorchFunctionMode` (PyTorch's public hook for every
`torch.*` call from Python) sends each `F.linear` whose input is one row on a CUDA device to the kernel,
and every other call through unchanged. A CUDA graph records the kernel like any other launch; under the
compiled step the kernel is one opaque operator (`kvpot::gemv`), so the compiler neither traces into the
Triton kernel (inductor's functionalisation of user kernels failed on the H100, as for the decode
kernels) nor breaks its graph there.

The engine applies the mode to every single-token forward, eager and captured alike, so a decoding
loop's paths agree with each other; prefill (many rows) never meets it. Under tensor parallelism the
kernel multiplies each rank's local shard (`resolve_linear`): 0.82x the one-GPU step at TP=2 where cuBLAS
on the shards gave 0.96x (records/tp-h200x2/gemv/).

`Engine(batch_invariant=True)` resolves to "invariant": every row of a decoding step (one sequence's one
row, or a batched step's rows) goes through `kvpot.kernels.invariant`, whose tiles are fixed, so a row's
products come out the same at any batch size.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kvpot.defaults import SPLIT_ENTRIES
from kvpot.errors import KvpotError

LINEARS = ("auto", "gemv", "torch")


def _launch(kernel, x: torch.Tensor, *args):
    """`kernel(x, *args)` on x's device: Triton launches on the current CUDA device (a model split over GPUs), and
    on a CPU the kernel runs in Triton's interpreter (the tests)."""
    if not x.is_cuda:
        return kernel(x, *args)
    with torch.cuda.device(x.device):
        return kernel(x, *args)


def _linear_op(name: str, kernel: str):
    """The operator `kvpot::NAME`: `F.linear` through `kvpot.kernels.KERNEL` where kvpot's kernels run; elsewhere
    (the modes' CPU tests) the plain product. Called at run time by a compiled step with the mode still active,
    it must not call `F.linear` itself."""

    @torch.library.custom_op(f"kvpot::{name}", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from kvpot import kernels

        if kernels.available(x.device):
            module, function = kernel.rsplit(".", 1)
            return _launch(getattr(importlib.import_module(f"kvpot.kernels.{module}"), function), x, weight, bias)
        out = x @ weight.t()
        return out if bias is None else out + bias

    op.register_fake(lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))
    return op


gemv_op = _linear_op("gemv", "gemv.gemv")  # one row at the memory's speed (`kvpot.kernels.gemv`)
invariant_op = _linear_op("invariant_linear", "invariant.invariant_linear")  # fixed tiles: rows independent


@torch.library.custom_op("kvpot::invariant_mean", mutates_args=())
def invariant_mean_op(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    """`x.mean(-1, keepdim)` in a fixed order (`kvpot.kernels.invariant.invariant_mean`): an RMSNorm's variance."""
    from kvpot import kernels

    if kernels.available(x.device):
        from kvpot.kernels.invariant import invariant_mean

        return _launch(invariant_mean, x, keepdim)
    return x.mean(-1, keepdim=keepdim)


@invariant_mean_op.register_fake
def _(x, keepdim):
    return x.new_empty(*x.shape[:-1], *((1,) if keepdim else ()))


_MEANS = (torch.mean, torch.Tensor.mean)


class SingleRowLinear(TorchFunctionMode):
    """Sends `F.linear` calls of one row on `devices` to `kvpot::gemv`. (It keeps no count: the compiled
    step traces this method, and a changing attribute would be a guard that fails at every step.)"""

    every_row = False  # EveryRowLinear: every row count, to `kvpot::invariant_linear`

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.devices = devices

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.every_row and func in _MEANS and self._last_dim_mean(args, kwargs):
            return invariant_mean_op(args[0], bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False)))
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if self._takes(x, weight, bias):
                return (invariant_op if self.every_row else gemv_op)(x, weight, bias)
            if self.every_row and x.device.type in self.devices:
                _not_routed(x, weight)
        return func(*args, **kwargs)

    def _takes(self, x, weight, bias) -> bool:
        # a DTensor (a sharded model whose TP forward did not hand its layer the local shard) goes to torch,
        # whose DTensor product holds the layout; transformers >= 5.17 runs inference on the local shards
        if _distributed(x, weight, bias):
            _warn_dtensor_once()
            return False
        if x.device.type not in self.devices or weight.device != x.device:
            return False
        one_row = x.numel() == x.shape[-1]
        if not (one_row or self.every_row) or weight.dim() != 2 or weight.stride(-1) != 1 or weight.dtype != x.dtype:
            return False
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False
        return bias is None or (bias.dtype == x.dtype and bias.device == x.device and bias.stride(-1) == 1)


def _distributed(*tensors) -> bool:
    return any(type(t).__name__ == "DTensor" for t in tensors if t is not None)


@functools.cache
def _warn_dtensor_once() -> None:
    warnings.warn("tensor parallelism: a linear layer handed kvpot DTensors (transformers < 5.17 does not run "
                  "inference on the local shards), so single-token steps use torch's product there, not kvpot's "
                  "matrix-vector kernel.", stacklevel=3)


@functools.cache
def _warn_once(what: str) -> None:
    warnings.warn(f"batch-invariant decoding: {what} went through torch's product, whose sums follow the batch.",
                  stacklevel=3)


def _not_routed(x: torch.Tensor, weight: torch.Tensor) -> None:
    _warn_once(f"a linear layer of {x.dtype} inputs and {weight.dtype} weights, shape {tuple(weight.shape)}")


class EveryRowLinear(SingleRowLinear):
    """Sends every `F.linear` of a decoding step (its rows: one, or a batch's) to `kvpot::invariant_linear`, and
    every mean over the last dimension (an RMSNorm's variance) to `kvpot::invariant_mean`."""

    every_row = True

    def _last_dim_mean(self, args, kwargs) -> bool:
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
        if not isinstance(x, torch.Tensor) or x.device.type not in self.devices or x.dim() == 0 or "dtype" in kwargs:
            return False
        return isinstance(dim, int) and dim in (-1, x.dim() - 1) and x.dtype in (torch.float32, torch.bfloat16,
                                                                                 torch.float16)


def resolve_linear(linear: str, device: torch.device, sharded: bool = False, invariant: bool = False) -> str:
    """`auto`: the kernel where kvpot's kernels run on a CUDA device, else torch's. A model `sharded` by
    transformers' tensor-parallel plan takes it too: at inference transformers' TP forward hands each
    projection its rank's local shard (plain tensors, `_use_local_dtensor_params`) and does its collectives
    around the product, so the kernel multiplies the shard and the layout stays transformers'. Where a layer
    still sees DTensors, the mode leaves it to torch (`SingleRowLinear._takes`). `invariant`
    (`Engine(batch_invariant=True)`): "invariant" where kvpot's kernels run, else torch's (a CPU, whose float32
    products gave every row the same tokens at any batch in the tests)."""
    if linear not in LINEARS:
        raise KvpotError(f"linear must be one of {LINEARS}, got {linear!r}.")
    if invariant:
        if linear != "auto":
            raise KvpotError(f"batch-invariant decoding chooses the linear layers' kernel itself; linear={linear!r} "
                             "would change it (leave linear at 'auto').")
        if sharded:
            raise KvpotError("batch-invariant decoding under tensor parallelism is not supported: the sharded "
                             "projections run transformers' own TP forward.")
        from kvpot import kernels

        return "invariant" if kernels.available(device) else "torch"
    from kvpot import kernels

    if linear == "gemv" and not (device.type == "cuda" and kernels.available(device)):
        raise KvpotError("linear='gemv' runs kvpot's Triton kernel: it needs a CUDA device and Triton.")
    if linear == "auto":
        return "gemv" if device.type == "cuda" and kernels.available(device) else "torch"
    return linear


def check_invariant_options(batch_invariant: bool, linear: str, tp: int | None) -> None:
    """`--batch-invariant` beside `--linear` or `--tp`, refused before a model loads (the CLI, `kvpot serve`'s recipe)."""
    if batch_invariant and (linear != "auto" or (tp or 1) != 1):
        raise KvpotError("--batch-invariant chooses the linear layers' kernel itself and does not run under tensor "
                         "parallelism: drop --linear / --tp.")


def decoding_numerics(linear: str, device: torch.device, sharded: bool, batch_invariant: bool, head_dim: int = 64,
                      decode: str = "auto") -> tuple[str, tuple[str, ...], int | None]:
    """An engine's (resolved linear mode, devices its single-token forwards route, the decode attention's fixed
    split size or None). Batch-invariant decoding: every decoding row's products on fixed tiles, routed on the
    engine's device, and splits of `kvpot.defaults.SPLIT_ENTRIES` entries; the batched scheduler reads prompts
    as one request alone does (`Scheduler`). On a GPU it needs kvpot's kernels (else it would silently be torch's
    sums) and the fixed-shape decoding steps (an eager step attends through SDPA, which a batch does not)."""
    if not isinstance(batch_invariant, bool):
        raise KvpotError(f"batch_invariant must be True or False, got {batch_invariant!r}.")
    if batch_invariant and device.type == "cuda":
        from kvpot import kernels

        if not (kernels.available(device) and kernels.supports_head_dim(head_dim)):
            raise KvpotError(f"batch-invariant decoding on a GPU runs kvpot's Triton kernels: it needs Triton and a "
                             f"head dim of 32, 64, 128 or 256 (this model's is {head_dim}).")
        if decode == "eager":
            raise KvpotError("decode='eager' under batch-invariant decoding on a GPU: an eager step attends through "
                             "SDPA, which a batch's steps do not; use decode='auto', 'graph' or 'static'.")
    resolved = resolve_linear(linear, device, sharded, invariant=batch_invariant)
    devices = (device.type,) if resolved == "invariant" else ("cuda",)
    return resolved, devices, SPLIT_ENTRIES if batch_invariant else None


def single_row_scope(linear: str, devices: tuple[str, ...] = ("cuda",)):
    """The context a single-token forward runs in: the routing mode for `gemv` or `invariant`, nothing for
    `torch`."""
    if linear == "invariant":
        return EveryRowLinear(devices)
    return SingleRowLinear(devices) if linear == "gemv" else contextlib.nullcontext()
