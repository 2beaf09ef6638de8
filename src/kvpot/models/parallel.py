"""Tensor parallelism: a model whose weights transformers sharded over a torch.distributed group.

transformers loads a model with its own tensor-parallel plan (`from_pretrained(distributed_config=
DistributedConfig(tp_size=N))`, started under `torchrun`): every rank holds a slice of each projection
(q/k/v/gate/up column-wise, o/down row-wise, each followed by transformers' all-reduce), so kvpot's attention
function and cache see the rank's own query and KV heads (`num_key_value_heads / N` of them) and the logits
come out whole and identical on every rank. Nothing else about the model changes, so the engine runs on each
rank as it does alone; what kvpot adds (docs/scaling.md, *Tensor parallelism*):

- `TensorParallel` names the group, the rank and the size, read from the model (`Engine` finds it);
- a method whose selection is shared by the KV heads (a score reduced over heads, a layer-wide choice, a
  budget computed from every head) must see every head's score, so it reduces across ranks here
  (`all_heads`: an all-gather of the per-head scores) before its top-k; per-KV-head selections never need a collective;
- sampling and the scheduler's plans are decided on rank 0 and broadcast, so no rank can drift.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvpot.errors import KvpotError


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor parameter; any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise KvpotError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of processes.") from None


def rank() -> int:
    """This process's rank as torchrun sets it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0") or 0)


def is_rank_zero() -> bool:
    """Whether this process prints, writes records and serves (always, outside torchrun)."""
    return rank() == 0


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group a model's weights are sharded over."""

    group: object  # torch.distributed ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> TensorParallel | None:
        """The model's tensor-parallel group, or None for a model on one process (or split by device_map).

        transformers' public `tp_size` says whether (and how far) it sharded the model. kvpot runs one
        tensor-parallel group spanning the whole torchrun world (`check_world`), so the group is the default
        one; reading transformers' own mesh would need a private attribute, and its weights are DTensors only
        from 5.17 on."""
        size = getattr(model, "tp_size", None) or 1
        if size <= 1:
            return None
        import torch.distributed as dist

        if not dist.is_initialized():
            raise KvpotError("this model is sharded for tensor parallelism but torch.distributed is not "
                             "initialized: load it with tp_size under torchrun.")
        check_world(size)
        return cls(group=dist.group.WORLD, rank=dist.get_rank(), size=size)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` reduced over every rank (`op`: sum, max or min), in place; the same tensor is returned."""
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return tensor

    def gather_heads(self, scores: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's `scores` (this rank's KV heads along `dim`) concatenated in rank order: the model's
        KV heads in their own order, as one process holds them (transformers' column-wise split gives rank r
        the r-th contiguous block of heads). A selection then reduces over them exactly as one process does,
        so every rank keeps the same positions and the tokens are those of one process, bit for bit (a sum
        of per-rank partial sums would round differently). Out of place, fixed shapes: inside a captured
        CUDA-graph step it is one NCCL all-gather."""
        import torch.distributed as dist

        moved = scores.movedim(dim, 0).contiguous()
        out = torch.empty((self.size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        dist.all_gather_into_tensor(out, moved, group=self.group)
        return out.movedim(0, dim)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place (sampled tokens: every rank continues with one)."""
        import torch.distributed as dist

        dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tensor

    def same_token(self, token: int, device: torch.device) -> int:
        """Rank 0's `token` (a host int) on every rank."""
        return int(self.broadcast(torch.tensor([token], dtype=torch.long, device=device)).item())

    def broadcast_object(self, value):
        """Rank 0's picklable `value` on every rank (what the scheduler agrees on before a step), over a gloo
        group (`host_group`): through NCCL, `broadcast_object_list` reads the object's size back from the
        device, so the host would wait for the previous step's kernels before planning the next one and the
        GPU would idle while it plans and launches; over gloo the host runs ahead as it does alone."""
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=host_group())
        return box[0]


_HOST_GROUP: list = []  # the process's gloo group over every rank, made at its first use


def host_group(timeout: float | None = None):
    """A gloo group over every rank of the torchrun, made once per process: objects the ranks exchange (a
    scheduler's step inputs, a TP server's turns) go through it, never through the device. Making it is a
    collective, so every rank makes it at the same point: a server at its start (with its `timeout`, seconds
    a rank waits for the others), else every rank's first `broadcast_object`, the same step's."""
    if not _HOST_GROUP:
        from datetime import timedelta

        import torch.distributed as dist

        _HOST_GROUP.append(dist.new_group(backend="gloo", timeout=None if timeout is None else
                                          timedelta(seconds=timeout)))
    return _HOST_GROUP[0]


def all_heads(parallel: TensorParallel | None, scores: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """`scores` over every KV head of the model: gathered from the ranks under tensor parallelism, else as
    they are. Call it where a method reduces per-KV-head scores over heads (a selection shared by the heads
    of a layer, or by layers): docs/scaling.md lists those methods."""
    return scores if parallel is None else parallel.gather_heads(scores, dim)


def check_world(tp_size: int) -> None:
    """Refuse a tensor-parallel size that is not the number of processes torchrun started."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise KvpotError(f"tp_size must be a positive number of processes, got {tp_size!r}.")
    world = world_size()
    if tp_size != world:
        hint = (f"start it with `torchrun --nproc-per-node {tp_size} ...`" if world == 1
                else f"give tp_size={world} (--tp {world}), or start torchrun with --nproc-per-node {tp_size}")
        raise KvpotError(f"tensor parallelism over {tp_size} processes, but this run has {world} (WORLD_SIZE): "
                         f"{hint}. kvpot runs one tensor-parallel group over every process torchrun starts.")


def check_heads(config, tp_size: int) -> None:
    """Refuse a split that would cut a head: query and KV heads must both divide by `tp_size`."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        divisors = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0]
        raise KvpotError(f"tensor parallelism over {tp_size} processes needs the {heads} query heads and the "
                         f"{kv_heads} KV heads to divide by {tp_size} (each rank holds whole heads); "
                         f"this model allows tp_size {', '.join(map(str, divisors))}.")
