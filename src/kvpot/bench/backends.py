"""Which kernels torch's SDPA may choose during a benchmark: `kvpot bench --sdpa no-cudnn|default`.

On an H100 with torch >= 2.11 (its cuDNN >= 9.15.1) `scaled_dot_product_attention` tries cuDNN's
attention first, and cuDNN builds an execution plan for every new key length (torch's plan cache in
aten/src/ATen/native/cudnn/MHA.cpp is keyed by s_q and s_kv), tens of ms of host time each. A
decoding step reads one key more than the last, so every step of a plain transformers decode (and of
kvpress' presses; one per layer for PyramidKVPress, whose layers differ in length: SmolLM2, 30 a step at
73 ms each in records/protocol-smollm2-gpu) builds a plan: plain transformers decoded `llama3-8b` at
~100 ms/token where ~30 ms was expected (records/decode-h100). FlashAttention and the memory-efficient
kernel read any length without a plan; the attention computed is the same exact softmax attention.

`no-cudnn` (the bench default) leaves cuDNN out of SDPA's choice so no baseline pays a plan build per
step; `default` is torch's own choice, every backend on, to measure what an out-of-the-box user gets.
The flags are process-wide and only matter on CUDA; CPU runs leave them alone. They govern SDPA's
dispatch only: kvpot's chunked-prefill split attention (`kvpot.kernels.sdpa`) calls cuDNN's operator
directly with one plan per chunk shape, whichever setting is chosen.
"""

from __future__ import annotations

from contextlib import contextmanager

SDPA_CHOICES = ("no-cudnn", "default")
DEFAULT_SDPA = "no-cudnn"
BACKENDS = ("flash", "mem_efficient", "math", "cudnn")


def enabled_backends() -> dict[str, bool]:
    """SDPA's backend flags as they stand: which kernels `scaled_dot_product_attention` may pick."""
    import torch

    return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in BACKENDS}


def set_sdpa_backends(choice: str, device: str) -> dict[str, bool]:
    """Apply `choice` ("no-cudnn" or "default") on a CUDA `device`; return the flags then enabled."""
    import torch

    if choice not in SDPA_CHOICES:
        raise ValueError(f"unknown SDPA setting {choice!r}; choose one of: {', '.join(SDPA_CHOICES)}")
    if str(device).startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(choice == "default")
    return enabled_backends()


def attention_backends(device: str) -> dict[str, bool]:
    """Leave cuDNN out of SDPA's backends on CUDA (flash, memory-efficient and math stay); which are on.
    What kvpress' processes (`kvpot.bench.kvpress_runner`, `kvpot.eval.kvpress_worker`) always do."""
    return set_sdpa_backends("no-cudnn", device)


@contextmanager
def sdpa_backends(choice: str, device: str):
    """`set_sdpa_backends` for the duration of a `with` block (yields the enabled flags), then the flags
    as they were: a library caller's own setting outlives one `run_bench`."""
    import torch

    before = enabled_backends()
    try:
        yield set_sdpa_backends(choice, device)
    finally:
        if before["cudnn"] != torch.backends.cuda.cudnn_sdp_enabled():
            torch.backends.cuda.enable_cudnn_sdp(before["cudnn"])
