"""Which attention kernels can carry kvpot's chunked prefill at transformers' speed (one H100).

One `llama3-8b` layer (32 query heads, 8 KV heads, head dim 128, bf16). Prints, as JSON lines:
- `square`: the causal self-attention of L tokens that transformers' one-shot prefill runs, under
  SDPA's own choice (and which backend that is) and under each backend forced;
- `chunk`: q new queries over n keys with lower-right causality (kvpot's chunk), as kvpot's
  `attend` does it today (one SDPA call with a lower-right bias), and split in two - the cached
  prefix without a mask, the chunk's own keys causal - each with its log-sum-exp, then merged;
- `observe`: H2O's all-rows observation next to the attention it accompanies.
Median of CUDA-event timings; TFLOP/s counts only the unmasked work.

    python benchmarks/prefill-h100/probe_attention.py
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvpot.attention import AttentionRequest, attend_with_lse, observe
from kvpot.kernels import sdpa

HEADS, KV, D = 32, 8, 128
DT = torch.bfloat16
SCALE = D**-0.5


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def tensors(q, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(1, HEADS, q, D, device="cuda", dtype=DT, generator=g)
    key = torch.randn(1, KV, n, D, device="cuda", dtype=DT, generator=g)
    value = torch.randn(1, KV, n, D, device="cuda", dtype=DT, generator=g)
    return query, key, value


def emit(**row):
    print(json.dumps(row), flush=True)


def try_time(fn):
    try:
        return round(timed(fn), 3)
    except Exception as err:  # noqa: BLE001 - a backend that refuses is a result
        return f"refused: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def square(L):
    query, key, value = tensors(L, L)
    flops = 4 * HEADS * D * L * L / 2
    choice = torch._fused_sdp_choice(query, key, value, None, 0.0, True, enable_gqa=True)
    row = {"case": "square", "L": L, "sdp_choice": str(SDPBackend(choice))}
    call = lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)  # noqa: E731
    row["default_ms"] = try_time(call)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def forced(backend=backend):
            with sdpa_kernel([backend]):
                return call()
        row[f"{name}_gqa_ms"] = try_time(forced)
    rk, rv = key.repeat_interleave(HEADS // KV, 1), value.repeat_interleave(HEADS // KV, 1)

    def cudnn_rep():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(query, rk, rv, is_causal=True)
    row["cudnn_repeated_ms"] = try_time(cudnn_rep)
    for k, v in list(row.items()):
        if k.endswith("_ms") and isinstance(v, float):
            row[k.replace("_ms", "_tflops")] = round(flops / v / 1e9, 1)
    emit(**row)


def cudnn_lse(query, key, value, causal):
    """cuDNN attention with its log-sum-exp; GQA folded into query rows when not causal."""
    b, h, q, d = query.shape
    kv = key.shape[1]
    if not causal and kv != h:
        folded = query.reshape(b, kv, (h // kv) * q, d)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            folded, key, value, None, True, 0.0, False, False, scale=SCALE)[:2]
        return out.reshape(b, h, q, d), lse.reshape(b, h, q)
    if kv != h:
        key, value = key.repeat_interleave(h // kv, 1), value.repeat_interleave(h // kv, 1)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, causal, False, scale=SCALE)[:2]
    return out, lse.reshape(b, h, q)


def flash_lse(query, key, value, causal):
    """FlashAttention-2 through aten (native GQA, lower-right causal) with its log-sum-exp."""
    out, lse = torch.ops.aten._flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
        query.shape[2], key.shape[2], 0.0, causal, False, scale=SCALE)[:2]
    return out.transpose(1, 2), lse


def merge(out_a, lse_a, out_b, lse_b):
    weight = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)  # share of part b in the joint softmax
    return out_a.float().lerp_(out_b.float(), weight).to(out_a.dtype)


def chunk(q, n):
    query, key, value = tensors(q, n)
    p = n - q
    flops = 4 * HEADS * D * (q * p + q * q / 2)
    reference = sdpa.lower_right(query, key, value, SCALE)
    row = {"case": "chunk", "q": q, "n": n}
    row["lower_right_ms"] = try_time(lambda: sdpa.lower_right(query, key, value, SCALE))
    row["kvpot_attend_ms"] = try_time(lambda: attend_with_lse(query, key, value, SCALE))
    variants = {
        "split_kvpot": lambda: sdpa.split_attention(query, key, value, SCALE)[0],
        "split_cudnn_fold+flash": lambda: merge(*cudnn_lse(query, key[:, :, :p], value[:, :, :p], False),
                                                *flash_lse(query, key[:, :, p:], value[:, :, p:], True)),
        "split_cudnn_fold+cudnn": lambda: merge(*cudnn_lse(query, key[:, :, :p], value[:, :, :p], False),
                                                *cudnn_lse(query, key[:, :, p:], value[:, :, p:], True)),
        "split_flash+flash": lambda: merge(*flash_lse(query, key[:, :, :p], value[:, :, :p], False),
                                           *flash_lse(query, key[:, :, p:], value[:, :, p:], True)),
        "prefix_cudnn_fold_only": lambda: cudnn_lse(query, key[:, :, :p], value[:, :, :p], False),
        "diag_flash_only": lambda: flash_lse(query, key[:, :, p:], value[:, :, p:], True),
    }
    for name, fn in variants.items():
        row[f"{name}_ms"] = try_time(fn)
        if name.startswith("split") and isinstance(row[f"{name}_ms"], float):
            got = fn()
            got = got[0] if isinstance(got, tuple) else got
            row[f"{name}_maxerr"] = float((got.float() - reference.float()).abs().max())
    for k, v in list(row.items()):
        if k.endswith("_ms") and isinstance(v, float) and "only" not in k:
            row[k.replace("_ms", "_tflops")] = round(flops / v / 1e9, 1)
    emit(**row)


def observation(q, n):
    """H2O's all-rows observation and CItruS' (normalised over the cached keys): the Triton kernels
    (`kvpot.kernels.observe`) against the PyTorch path (scores materialised, softmax)."""
    from kvpot import attention

    query, key, value = tensors(q, n)
    _, lse = attend_with_lse(query, key, value, SCALE)
    h2o = AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")
    citrus = AttentionRequest(rows=None, row_reduce="mean", head_reduce="mean", over="cached")
    row = {"case": "observe", "q": q, "n": n,
           "attend_ms": try_time(lambda: attend_with_lse(query, key, value, SCALE)),
           "h2o_kernel_ms": try_time(lambda: observe(query, key, h2o, SCALE, lse)),
           "citrus_kernel_ms": try_time(lambda: observe(query, key, citrus, SCALE, lse))}
    kernel_ok = attention._kernel_ok
    attention._kernel_ok = lambda query: False
    try:
        row["h2o_pytorch_ms"] = try_time(lambda: observe(query, key, h2o, SCALE, lse))
        row["citrus_pytorch_ms"] = try_time(lambda: observe(query, key, citrus, SCALE, lse))
    finally:
        attention._kernel_ok = kernel_ok
    emit(**row)


if __name__ == "__main__":
    emit(case="split_ok", value=sdpa.split_ok(torch.device("cuda"), DT, D))
    emit(case="versions", torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
         gpu=torch.cuda.get_device_name())
    for L in (16384, 32768):
        square(L)
    for q, n in ((2048, 6144), (2048, 34816), (2048, 133120), (4096, 133120), (8192, 133120), (512, 4608)):
        chunk(q, n)
    for q, n in ((512, 4608), (2048, 6144), (2048, 34816)):
        observation(q, n)
