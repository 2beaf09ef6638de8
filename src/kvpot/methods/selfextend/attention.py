"""Self-Extend's attention for a forward of `q` new tokens over `n` cached entries (prefill, eager steps).

Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning", Sec. 3.2: a query at
stream position i and a key at j get the relative position i - j when i - j < W (neighbour attention),
and floor(i / G) - floor(j / G) + W - floor(W / G) otherwise (grouped attention); the two score maps are
merged before one softmax (their Eq. for the merged attention, and `torch.where` in the authors' code).

Since the two maps cover disjoint key sets for each query, one softmax over their union is two
attentions, each with its log-sum-exp, merged exactly (`kvpot.kernels.sdpa.merge`): InfiniteHiP's split
attention. Keys arrive un-rotated (`positions="self-extend"`) and are rotated here per use:

- neighbour: keys from W - 1 before the forward's first query, queries and keys in a frame that starts at
  the first of them (only differences matter to RoPE; the RoPE table stays W + q long);
- grouped: keys at floor(j / G), queries at floor(i / G) + W - floor(W / G); query i sees keys j <= i - W,
  a lower-right causal mask of the forward's queries over the first n - W keys.

The grouped part runs as an unmasked prefix (in blocks of `KEY_BLOCK` keys, so its rotated copy stays
bounded) plus a square causal block, each with its log-sum-exp, on fused kernels (`backend`): on CUDA in
half precision cuDNN's (`kvpot.kernels.sdpa`) with the neighbour part on FlashAttention-2's sliding window,
on a CPU PyTorch's flash kernel (the neighbour part with a band mask, in row slices). Each backend is
checked once against the explicit path, which computes masked scores in float32 in row slices of at most
`MAX_BLOCK_ELEMENTS` and runs everywhere else (CUDA in float32). Nothing materialises `[q, n]` for the
whole context.
"""

from __future__ import annotations

import functools

import torch

from kvpot.attention import MAX_BLOCK_ELEMENTS
from kvpot.kernels import sdpa
from kvpot.rope import Rope, rotate_half

KEY_BLOCK = 1 << 17  # grouped keys rotated at once on the fused path (128K keys: 32 MiB a KV head in bf16)


def grouped_query_positions(stream: torch.Tensor, group: int, window: int) -> torch.Tensor:
    """floor(i / G) + W - floor(W / G): where the grouped attention puts query i."""
    return stream // group + (window - window // group)


def rotate(rope: Rope, x: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
    """x [..., t, d] rotated at positions [t] (`max_position` bounds them, on the host)."""
    cos, sin = rope.cos_sin(positions, x, max_position)
    return x * cos + rotate_half(x) * sin


def self_extend_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                          stream: torch.Tensor, group: int, window: int, rope: Rope, max_position: int,
                          backend: str | None = None) -> torch.Tensor:
    """Self-Extend attention of the last `q` entries' queries over all `n` entries.

    query [h, q, d] un-rotated (entries n - q .. n - 1), keys/values [kv, n, d] (keys un-rotated), stream
    [n] each entry's stream position (consecutive: nothing is evicted), `max_position` a host bound of
    them. `backend` "cuda", "cpu" or "explicit"; None picks the fastest that runs here (`pick_backend`).
    Returns [h, q, d] in query's dtype.
    """
    h, q, d = query.shape
    n = keys.shape[1]
    s = n - q  # the first query's entry
    backend = backend or pick_backend(query)
    device = query.device
    first = max(0, s - window + 1)  # the first key any query sees as a neighbour
    frame = n - first
    neighbour_q = rotate(rope, query, torch.arange(s - first, frame, device=device), frame)
    neighbour_k = rotate(rope, keys[:, first:], torch.arange(frame, device=device), frame)
    out, lse = BANDS[backend](neighbour_q, neighbour_k, values[:, first:], scaling, window)
    grouped_keys = n - window  # entries [0, m) are grouped for the last query
    if grouped_keys <= 0:
        return out.to(query.dtype)
    rows = min(q, grouped_keys)  # the first q - rows queries see no grouped key
    top = max_position // group + window
    grouped_q = rotate(rope, query[:, q - rows :], grouped_query_positions(stream[n - rows :], group, window), top)
    key_positions = stream[:grouped_keys] // group
    args = (grouped_q, keys[:, :grouped_keys], values[:, :grouped_keys], key_positions, scaling,
            lambda x, at: rotate(rope, x, at, top))
    out_g, lse_g = _grouped_explicit(*args) if backend == "explicit" else _grouped_fused(*args, backend=backend)
    merged, _ = sdpa.merge(out[:, q - rows :], lse[:, q - rows :], out_g, lse_g)
    out = out.to(query.dtype)
    out[:, q - rows :] = merged.to(query.dtype)
    return out


# ---------------------------------------------------------------------------- explicit (any device)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
            allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [h, r, d], keys/values [kv, t, d] (rotated), allowed [r, t] (every row allows a key):
    out [h, r, d] float32 and lse [h, r] float32, GQA without repeating keys."""
    h, r, d = query.shape
    kv = keys.shape[0]
    grouped = query.float().view(kv, h // kv, r, d)
    scores = torch.einsum("kgrd,ktd->kgrt", grouped, keys.float()).mul_(scaling)
    scores.masked_fill_(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    out = torch.einsum("kgrt,ktd->kgrd", probs, values.float())
    return out.reshape(h, r, d), lse.reshape(h, r)


def _row_slices(rows: int, heads: int, keys: int):
    step = max(1, MAX_BLOCK_ELEMENTS // max(1, heads * keys))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


def _band_explicit(query, keys, values, scaling: float, window: int):
    """Neighbour attention: the last `r` of `t` entries' queries, query i over keys (i - W, i]."""
    return _band_slices(query, keys, values, scaling, window, _attend)


def _band_slices(query, keys, values, scaling: float, window: int, attend):
    """The band in row slices, each slice's keys and its boolean mask handed to `attend(q, k, v, scaling,
    allowed)` -> (out, lse); the slices' outputs concatenated."""
    h, r, _ = query.shape
    t = keys.shape[1]
    outs, lses = [], []
    for lo, hi in _row_slices(r, h, min(t, window + r)):
        first = max(0, t - r + lo - window + 1)
        key_at = torch.arange(first, t - r + hi, device=keys.device)
        row_at = torch.arange(t - r + lo, t - r + hi, device=keys.device).unsqueeze(-1)
        allowed = (key_at <= row_at) & (key_at > row_at - window)
        out, lse = attend(query[:, lo:hi], keys[:, first : t - r + hi], values[:, first : t - r + hi], scaling,
                          allowed)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _grouped_explicit(query, keys, values, key_positions, scaling: float, turn):
    """Grouped attention: `r` queries over `m >= r` keys, lower-right causal (row i sees keys <= m - r + i)."""
    h, r, _ = query.shape
    m = keys.shape[1]
    rotated = turn(keys, key_positions)
    outs, lses = [], []
    for lo, hi in _row_slices(r, h, m):
        visible = m - r + hi
        allowed = torch.arange(visible, device=keys.device) <= (m - r + torch.arange(lo, hi, device=keys.device))[:, None]
        out, lse = _attend(query[:, lo:hi], rotated[:, :visible], values[:, :visible], scaling, allowed)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


# ---------------------------------------------------------------------------- fused kernels


def _band_flash(query, keys, values, scaling: float, window: int):
    """`_band_explicit` on FlashAttention-2's sliding window (bottom-right aligned causal, W - 1 keys back)."""
    h, r, d = query.shape
    t = keys.shape[1]
    out, lse = torch.ops.aten._flash_attention_forward(
        query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        None, None, r, t, 0.0, True, False, scale=scaling, window_size_left=window - 1, window_size_right=0)[:2]
    return out[0].transpose(0, 1), lse.reshape(h, r)


def _cpu_flash(query, keys, values, scaling: float, causal: bool = False, bias: torch.Tensor | None = None):
    """PyTorch's CPU flash attention with its log-sum-exp: query [h, r, d], keys/values [kv, t, d] (GQA read
    per KV head), causal square or an additive `bias` [r, t]; out [h, r, d], lse [h, r] float32."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), 0.0, causal, attn_mask=bias, scale=scaling)
    return out[0], lse[0]


def _band_cpu(query, keys, values, scaling: float, window: int):
    """`_band_explicit` on the CPU flash kernel, with the band as an additive mask of each row slice."""
    def attend(q, k, v, scale, allowed):
        bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
        return _cpu_flash(q, k, v, scale, bias=bias)

    return _band_slices(query, keys, values, scaling, window, attend)


def _own(query, keys, values, scaling: float, backend: str):
    """Square causal attention with its lse: query [h, r, d] over keys/values [kv, r, d]."""
    if backend == "cpu":
        return _cpu_flash(query, keys, values, scaling, causal=True)
    out, lse = sdpa.own_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scaling)
    return out[0], lse[0]


def _prefix(query, keys, values, scaling: float, backend: str):
    """Unmasked attention with its lse: query [h, r, d] over keys/values [kv, t, d]."""
    if backend == "cpu":
        return _cpu_flash(query, keys, values, scaling)
    out, lse = sdpa.prefix_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scaling)
    return out[0], lse[0]


def _grouped_fused(query, keys, values, key_positions, scaling: float, turn, backend: str):
    """`_grouped_explicit` as fused attentions: the keys all rows see (unmasked, in blocks) and the last
    `r` keys (square causal), merged by their log-sum-exps."""
    r = query.shape[1]
    m = keys.shape[1]
    own = turn(keys[:, m - r :], key_positions[m - r :])
    out, lse = _own(query, own, values[:, m - r :], scaling, backend)
    for lo in range(0, m - r, KEY_BLOCK):
        hi = min(m - r, lo + KEY_BLOCK)
        block = turn(keys[:, lo:hi], key_positions[lo:hi])
        out, lse = sdpa.merge(*_prefix(query, block, values[:, lo:hi], scaling, backend), out, lse)
    return out, lse


BANDS = {"explicit": _band_explicit, "cpu": _band_cpu, "cuda": _band_flash}


def pick_backend(query: torch.Tensor) -> str:
    """"cuda" (cuDNN + FlashAttention, half precision), "cpu" (PyTorch's CPU flash kernel) or "explicit",
    each fused backend checked once on this device against the explicit path."""
    if query.device.type == "cpu":
        return "cpu" if _backend_ok("cpu", None, query.dtype, query.shape[-1]) else "explicit"
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return "explicit"
    if not sdpa.split_ok(query.device, query.dtype, query.shape[-1]):
        return "explicit"
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    return "cuda" if _backend_ok("cuda", index, query.dtype, query.shape[-1]) else "explicit"


@functools.cache
def _backend_ok(backend: str, index: int | None, dtype: torch.dtype, head_dim: int) -> bool:
    device = torch.device(backend, index) if index is not None else torch.device(backend)
    generator = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(4, 80, head_dim, device=device, dtype=dtype, generator=generator)
    keys = torch.randn(2, 200, head_dim, device=device, dtype=dtype, generator=generator)
    values = torch.randn(2, 200, head_dim, device=device, dtype=dtype, generator=generator)
    positions = torch.arange(120, device=device)
    try:
        got = BANDS[backend](query, keys, values, head_dim**-0.5, 37)
        got += _grouped_fused(query, keys[:, :120], values[:, :120], positions, head_dim**-0.5, lambda x, _: x, backend)
    except Exception:  # noqa: BLE001 - the kernel does not run here: the explicit path it is
        return False
    want = _band_explicit(query, keys, values, head_dim**-0.5, 37)
    want += _grouped_explicit(query, keys[:, :120], values[:, :120], positions, head_dim**-0.5, lambda x, _: x)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    return all(bool((a.float() - b.float()).abs().max() < tolerance) for a, b in zip(got, want))
