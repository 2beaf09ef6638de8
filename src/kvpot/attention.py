"""The `kvpot` attention function, registered with transformers' `AttentionInterface`.

The model calls it with this forward's queries and with the keys/values `PotCache.update`
returned (already rotated at the policy's positions). It rotates the queries at the positions of
the new entries, computes the output with `scaled_dot_product_attention(enable_gqa=True)` (no
`repeat_kv`), and, only when a method asked (`cache.request`), records attention probabilities of
chosen query rows over the cached entries, reduced over the query heads of each KV group.

Causality: the new entries are the last `q` of the cache, so query row `i` sees every older entry
and new entries up to itself ("lower-right" causal alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvpot.errors import KvpotError
from kvpot.kernels import sdpa

ATTENTION_NAME = "kvpot"

# Elements of one materialised [rows, keys] float block (per batch x head). 2**26 floats = 256 MiB
# bounds the memory of the CPU math path and of observations, whatever the context length.
MAX_BLOCK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class AttentionRequest:
    """Which attention probabilities the next forward records in every layer's `observation`.

    rows: `(start, stop)` of this forward's query rows, Python-slice style (negative counts from
        the end; `None` = all rows).
    row_reduce: "sum" or "mean" over those rows.
    head_reduce: "mean" or "max" over the query heads of each KV group, giving
        `[b, kv_heads, n]`; "none" keeps query heads, giving `[b, heads, n]`.
    over: "all" normalises each row's softmax over every key it sees (the model's own attention
        probabilities); "cached" normalises over the entries cached before this forward only and
        gives the forward's own entries 0 (CItruS eq. 1, whose denominator runs over the cache C).
    keys: with over="cached", normalise over the first `keys` entries only (the others get 0).
    """

    rows: tuple[int | None, int | None] | None = None
    row_reduce: str = "sum"
    head_reduce: str = "mean"
    over: str = "all"
    keys: int | None = None

    def __post_init__(self):
        if self.over not in ("all", "cached"):
            raise KvpotError(f"over must be 'all' or 'cached', not {self.over!r}.")
        if self.row_reduce not in ("sum", "mean"):
            raise KvpotError(f"row_reduce must be 'sum' or 'mean', not {self.row_reduce!r}.")
        if self.head_reduce not in ("mean", "max", "none"):
            raise KvpotError(f"head_reduce must be 'mean', 'max' or 'none', not {self.head_reduce!r}.")


class LayerView:
    """`cache.layers[index]` as the whole cache of one decoder layer's call in a compiled decoding step
    (`kvpot.engine.regions`), for a PotCache or a batched step's StepCache.

    transformers' attention modules find their cache layer by index (`cache.update(k, v, self.layer_idx)`),
    and `torch.compile` treats an nn.Module's integer attributes as constants: a decoder layer compiled
    once for all layers would be recompiled for each `layer_idx`. A view carries its layer instead:
    `update` leaves the index unread and `kvpot_attention` takes the layer from the view (`layer_of`),
    so the layers differ only in tensors and share one compilation.
    """

    def __init__(self, cache, index: int):
        self.cache = cache
        self.layer = cache.layers[index]

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)


def layer_of(cache, module):
    """(cache, layer) that the attention module `module` reads: from a view, without its `layer_idx`."""
    if isinstance(cache, LayerView):
        return cache.cache, cache.layer
    return cache, cache.layers[module.layer_idx]


# kwargs that would change the attention's meaning; kvpot refuses them rather than ignore them.
_REFUSED = {
    "sliding_window": "sliding-window attention",
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sink logits",
}


def kvpot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, q, d], un-rotated (positions were 0)
    key: torch.Tensor,  # [b, kv_heads, n, d], rotated by PotCache.update
    value: torch.Tensor,  # [b, kv_heads, n, d]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvpot_cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    _refuse_unsupported(attention_mask, dropout, kvpot_cache, kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    kvpot_cache, layer = layer_of(kvpot_cache, module)  # a compiled step hands each layer a LayerView
    if getattr(kvpot_cache, "batched", False):  # one token for each of many pool slots (kvpot.engine.batch)
        return kvpot_cache.attend(layer, query, scaling), None
    if kvpot_cache.static:  # a fixed-shape decoding step (kvpot.engine.decoding)
        if kvpot_cache.attention is not None:  # a method's sparse attention in fixed shapes (InfLLM)
            output = kvpot_cache.attention.static_attention(layer, kvpot_cache.rope.unscale(query), key, value, scaling)
            return output.transpose(1, 2).contiguous(), None
        return static_attention(kvpot_cache, layer, query, scaling), None
    if kvpot_cache.attention is not None:  # a method's sparse attention (InfiniteHiP) rotates for itself
        if kvpot_cache.request is not None:
            raise KvpotError("attention observations are not available with a sparse attention method.")
        output = kvpot_cache.attention(layer, kvpot_cache.rope.unscale(query), key, value, scaling)
        return output.transpose(1, 2).contiguous(), None
    return sequence_attention(kvpot_cache, layer, query, key, value, scaling), None


def sequence_attention(cache, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """A sequence's forward over its own `PotCache` layer: query [b, heads, q, d] un-rotated, key/value what
    `PotLayer.update` returned; records the observation `cache.request` asks for. Returns [b, q, heads, d]."""
    query = layer.rotate_queries(query)
    output, lse = attend_with_lse(query, key, value, scaling)  # [b, heads, q, d], [b, heads, q] | None
    if cache.request is not None:
        layer.observation = observe(query, key, cache.request, scaling, lse)
    return output.transpose(1, 2).contiguous()


def static_attention(cache, layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One decoding token over a layer's whole buffers, `layer.length` of them live.

    query [1, heads, 1, d], un-rotated. Keys are rotated while they are loaded, from the positions
    stored with them (no policy re-rotates the cache per step); under `absolute` they were stored
    rotated and only the query turns. Writes the method's observation when one was asked for
    (the mean over each group's query heads of the token's attention, as `observe` gives it).
    Returns [1, 1, heads, d].
    """
    rope, policy = cache.rope, cache.policy
    query = rope.unscale(query)
    kv = layer.kv_heads
    probs = layer.probs if cache.request is not None else None
    if policy.stores_rotated:
        turned = rope.rotate(query, layer.query_position.view(1, 1, 1).expand(1, kv, 1), cache.pending_max_position)
        args = dict(cos=None, sin=None, key_positions=None, query_position=None)
    else:
        turned = query
        cos, sin = rope.table(layer.capacity + 1, query)
        args = dict(cos=cos, sin=sin, key_positions=layer.rope_positions[0], query_position=layer.query_position[0])
    kernel = decode_kernel(query.device, query.shape[-1])
    out = kernel(turned[0, :, 0], layer.keys[0], layer.values[0], layer.length[0], scaling, probs=probs,
                 split_entries=cache.split_entries, **args)
    if probs is not None:
        layer.observation = probs[None, :, : layer.n]  # host count: the live entries when captured
    return out.view(1, 1, *out.shape)


def decode_kernel(device: torch.device, head_dim: int):
    """The Triton decode kernel where it runs, else its PyTorch reference (same arguments)."""
    from kvpot import kernels

    if kernels.available(device) and kernels.supports_head_dim(head_dim):
        from kvpot.kernels.decode import decode_attention

        return decode_attention
    from kvpot.kernels.decode_reference import decode_attention_reference

    return decode_attention_reference


def _refuse_unsupported(attention_mask, dropout, cache, kwargs) -> None:
    if cache is None:
        raise KvpotError(
            "this model's attention was set to 'kvpot' by kvpot.Engine and runs only inside it; to call the "
            "model directly again, run model.set_attn_implementation('sdpa')."
        )
    if attention_mask is not None:
        raise KvpotError("kvpot does not take attention masks (padded batches are not supported).")
    if dropout:
        raise KvpotError("kvpot attention is for inference; attention dropout must be 0.")
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise KvpotError(f"this model asks for {what} ({name}={kwargs[name]!r}), which kvpot does not support yet.")


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal (lower-right aligned) GQA attention of `q` new rows over `n` keys: [b, heads, q, d]."""
    return attend_with_lse(query, key, value, scaling)[0]


def attend_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """`attend`, plus each row's log-sum-exp [b, heads, q] float32 when the kernel gives it (else None).

    On CUDA in half precision: the chunk split into its cached prefix and its own keys on cuDNN's
    kernels (`kvpot.kernels.sdpa`, as fast as transformers' one-shot causal forward), or where that
    is not available one SDPA call with a lower-right bias; neither materialises the scores. Elsewhere
    the math path would materialise `[heads, q, n]`; the query rows are then taken in slices so
    each slice stays under `MAX_BLOCK_ELEMENTS`.
    """
    b, heads, q, _ = query.shape
    n = key.shape[-2]
    if q == 1:
        # Decoding: GQA-native SDPA. (Folding each group's heads into query rows without
        # enable_gqa measured 8x slower on an H100: 11.6 ms vs 1.38 ms per layer at 1M keys,
        # records/bench-h100/attention-after.)
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True), None
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        if sdpa.split_ok(query.device, query.dtype, query.shape[-1]):
            return sdpa.split_attention(query, key, value, scaling)
        return sdpa.lower_right(query, key, value, scaling), None
    rows = max(1, MAX_BLOCK_ELEMENTS // (b * heads * n))
    outputs = []
    for start in range(0, q, rows):
        stop = min(q, start + rows)
        visible = n - q + stop  # keys the last row of this slice may see
        outputs.append(sdpa.lower_right(query[:, :, start:stop], key[:, :, :visible], value[:, :, :visible], scaling))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)), None


def observe(
    query: torch.Tensor, key: torch.Tensor, request: AttentionRequest, scaling: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities of the requested query rows over all `n` keys, reduced.

    query [b, heads, q, d] (rotated), key [b, kv_heads, n, d] (rotated). Probabilities in float32
    with the same causal rule as `attend`. `lse` [b, heads, q], the rows' log-sum-exp from the
    attention kernel, turns each score into its probability directly (`exp(s - lse)`, no softmax
    pass); requests normalised over the cached entries only compute their own. Returns float32
    `[b, kv_heads, n]` (or `[b, heads, n]` for head_reduce="none"). Rows are processed in slices,
    so at most `MAX_BLOCK_ELEMENTS` scores exist at once.
    """
    b, heads, q, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    start, stop, _ = slice(*(request.rows or (None, None))).indices(q)
    count = stop - start
    if count <= 0:
        raise KvpotError(f"observation rows {request.rows} select no query row of {q}.")
    grouped = query[:, :, start:stop].reshape(b, kv_heads, group, count, d)
    per_head = torch.zeros(b, kv_heads, group, n, dtype=torch.float32, device=query.device)
    cached = n - q  # entries that existed before this forward
    if request.over == "cached":
        n_seen = cached if request.keys is None else min(request.keys, cached)
        if n_seen == 0:
            return _reduce_heads(per_head, request.head_reduce, b, heads)  # nothing cached yet
        keys, lse = key[:, :, :n_seen], None
    else:
        n_seen, keys = n, key
    if request.head_reduce == "mean" and (lse is not None or request.over == "cached") and _kernel_ok(query):
        from kvpot.kernels.observe import observe_columns

        columns = observe_columns(query, key, start, stop, scaling, lse, n_keys=n_seen)  # [1, kv, n_seen]
        observed = torch.zeros(b, kv_heads, n, dtype=torch.float32, device=query.device)
        observed[..., :n_seen] = columns / (group * (count if request.row_reduce == "mean" else 1))
        return observed
    if lse is not None:
        lse = lse[:, :, start:stop].reshape(b, kv_heads, group, count, 1)
    step = max(1, MAX_BLOCK_ELEMENTS // (b * heads * n))
    own = torch.arange(cached, max(cached, n_seen), device=query.device)  # this forward's keys: causal
    for lo in range(0, count, step):
        hi = min(count, lo + step)
        logits = _scores(grouped[:, :, :, lo:hi], keys, scaling)  # [b, kv, g, rows, n_seen] float32
        if own.numel():  # every row sees all cached keys; only the forward's own keys need a mask
            rows = torch.arange(start + lo, start + hi, device=query.device)
            logits[..., cached:].masked_fill_(own[None, :] > (cached + rows)[:, None], float("-inf"))
        if lse is None:
            probs = logits.softmax(dim=-1)
        else:
            probs = logits.sub_(lse[:, :, :, lo:hi]).exp_()
        per_head[..., :n_seen] += probs.sum(dim=3)  # [b, kv, g, n_seen]
    if request.row_reduce == "mean":
        per_head /= count
    return _reduce_heads(per_head, request.head_reduce, b, heads)


def _kernel_ok(query: torch.Tensor) -> bool:
    """Whether the Triton observation kernels (`kvpot.kernels.observe`) take this query."""
    from kvpot import kernels

    if not kernels.available(query.device):
        return False
    from kvpot.kernels.observe import supports

    return supports(query)


def _scores(grouped: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled scores [b, kv, g, r, n] float32 of query rows grouped [b, kv, g, r, d] over keys [b, kv, n, d].

    Half-precision CUDA inputs multiply on the tensor cores with float32 results (the products of
    two half-precision numbers are exact in float32, so this is the float32 product up to summation
    order); elsewhere both sides are cast to float32.
    """
    b, kv, g, r, d = grouped.shape
    if grouped.is_cuda and grouped.dtype in (torch.float16, torch.bfloat16):
        flat = grouped.reshape(b * kv, g * r, d)
        logits = torch.bmm(flat, keys.reshape(b * kv, -1, d).transpose(1, 2), out_dtype=torch.float32)
        return logits.mul_(scaling).view(b, kv, g, r, -1)
    return torch.einsum("bkgrd,bknd->bkgrn", grouped.float(), keys.float()) * scaling


def _reduce_heads(probs: torch.Tensor, how: str, b: int, heads: int) -> torch.Tensor:
    # probs: [b, kv_heads, group, n]
    if how == "mean":
        return probs.mean(dim=2)
    if how == "max":
        return probs.amax(dim=2)
    return probs.reshape(b, heads, -1)


def register() -> str:
    """Register the kvpot attention (idempotent) and return its name."""
    AttentionInterface.register(ATTENTION_NAME, kvpot_attention)
    return ATTENTION_NAME
