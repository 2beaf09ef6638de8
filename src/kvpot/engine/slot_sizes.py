"""How big a pool's slots are and how many fit: a slot's capacity, its bytes, and the one memory check of a pool
(`slot_count`, for the library and the server alike). `kvpot.engine.pool` holds the slots themselves."""

from __future__ import annotations

import torch

from kvpot.defaults import GIVEN_SLOTS_MEMORY_FRACTION
from kvpot.errors import KvpotError


def tail_stride(stride: int | None, slots: int, capacity: int) -> int | None:
    """The slot stride a pool of `slots` slots keeps for tail slots of `stride` lanes: None (slots apart) where tails
    gain nothing (a stride as wide as a slot), or where the slots' lanes would not hold one whole slot beside the
    scratch slot's (a sequence that needs one would wait for ever)."""
    return None if stride is None or stride >= capacity or stride * slots < capacity else stride


def kv_shape(config, tp: int = 1) -> tuple[int, int]:
    """(KV heads, head dim) of a model's attention layers, from its config; with tensor parallelism over `tp`
    processes, the KV heads one rank holds (the model's own split: `kvpot.models.parallel.check_heads`)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads // tp, head_dim


def slot_nbytes(config, capacity: int, dtype: torch.dtype, scores: int = 1, observed: bool = True,
                tp: int = 1, lanes: int | None = None) -> int:
    """Bytes one slot takes in a pool (on each rank, with tensor parallelism over `tp`): keys and values (of
    `lanes` entries with tail slots, else `capacity`), two position arrays (int64), `scores` float32 score arrays
    and, with `observed`, the batched step's observation row."""
    kv_heads, head_dim = kv_shape(config, tp)
    element = torch.empty((), dtype=dtype).element_size()
    per_entry = 2 * 8 + 4 * scores + (4 if observed else 0)
    kv = 2 * head_dim * element * (capacity if lanes is None else min(lanes, capacity))
    return config.num_hidden_layers * kv_heads * (capacity * per_entry + kv)


def slot_bytes(engine, capacity: int, dtype: torch.dtype | None = None, lanes: int | None = None) -> int:
    """Bytes one slot of `capacity` entries takes for `engine`'s model: KV (`lanes` a slot with tail slots),
    positions, the method's score arrays (`Method.score_arrays`), the observation row, and the slot's last logits
    (float32)."""
    dtype = dtype or engine.head.weight.dtype
    vocab = engine.head.weight.shape[0]
    tp = engine.parallel.size if engine.parallel is not None else 1
    return slot_nbytes(engine.model.config, capacity, dtype, scores=engine.method.score_arrays, tp=tp,
                       lanes=lanes) + 4 * vocab


def slot_capacity(method, capacity: int | None, question_room: int) -> int:
    """Entries per slot: `capacity` if given, else the method's bound (with room for a question where the
    bound counts it); a method whose cache grows with the input needs it given."""
    if capacity is None:
        if method.max_entries() is None:
            raise KvpotError(f"{method.name} keeps a cache that grows with the input; give the batch a "
                             "capacity (KV entries per sequence: prompt + new tokens).")
        return method.entries_needed(0, question_room, 0)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise KvpotError(f"capacity must be a positive integer, got {capacity!r}.")
    return capacity


def slot_count(engine, capacity: int, slots: int | None, max_slots: int, fraction: float, dtype: torch.dtype,
               lanes: int | None = None) -> int:
    """`slots` if given (on a GPU: if they fit in `GIVEN_SLOTS_MEMORY_FRACTION` of its free memory), else as
    many as fit in `fraction` of the GPU's free memory (at most `max_slots`), or 8 on a CPU. The one memory
    check of a pool, for the library and the server alike. With tail slots (`lanes`), `max_slots` counts readers: a
    reader's tail lies its document's length into its slot, so the last `capacity / lanes` slots' tails would reach
    the scratch slot's lanes, and as many more slots are given."""
    if lanes is not None and lanes < capacity:
        max_slots += -(-capacity // lanes)
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise KvpotError(f"slots must be a positive integer, got {slots!r}.")
        if engine.device.type == "cuda":  # (the lanes the pool keeps: whole slots where tails gain nothing)
            need = slots * slot_bytes(engine, capacity, dtype, tail_stride(lanes, slots, capacity))
            free, _ = torch.cuda.mem_get_info(engine.device)
            if need > free * GIVEN_SLOTS_MEMORY_FRACTION:
                raise KvpotError(f"{slots} slots of {capacity:,} entries take {need / 2**30:.2f} GiB and "
                                 f"{free / 2**30:.2f} GiB of GPU memory is free; ask for fewer slots.")
        return slots
    if engine.device.type != "cuda":
        return min(8, max_slots)
    free, _ = torch.cuda.mem_get_info(engine.device)
    fits = int(free * fraction) // slot_bytes(engine, capacity, dtype, lanes)
    if lanes is not None and tail_stride(lanes, min(fits, max_slots), capacity) is None:  # whole slots after all
        max_slots -= -(-capacity // lanes) if lanes < capacity else 0
        lanes, fits = None, int(free * fraction) // slot_bytes(engine, capacity, dtype)
    per_slot = slot_bytes(engine, capacity, dtype, lanes)
    if engine.parallel is not None:  # every rank must run the same slots: the one with least memory decides
        fits = int(engine.parallel.all_reduce(torch.tensor([fits], device=engine.device), op="min").item())
    if fits < 1:
        raise KvpotError(f"one slot of {capacity:,} entries takes {per_slot / 2**30:.2f} GiB and only "
                         f"{free / 2**30:.2f} GiB of GPU memory is free; lower the capacity or free memory.")
    return min(fits, max_slots)
