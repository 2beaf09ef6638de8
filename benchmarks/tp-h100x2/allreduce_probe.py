"""How long one all-reduce of a decoding step's activations takes between this machine's GPUs (issue 45).

Under torchrun (one process a GPU): NCCL all-reduces of SIZES bytes (bf16), captured in a CUDA graph of 64 calls
(a step's two per layer) and replayed, as a TP step runs them; prints us per call, and which transport NCCL chose
(NCCL_DEBUG=INFO lines name P2P/CUMEM, SHM or NET). Writes OUT/allreduce-<NCCL_PROTO or default>.json on rank 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = (8 * 1024, 64 * 1024, 512 * 1024, 4 * 1024 * 1024)


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    peer = torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None
    rows = []
    for size in SIZES:
        x = torch.zeros(size // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(64):
                dist.all_reduce(x)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        begun = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        us = (time.perf_counter() - begun) / (20 * 64) * 1e6
        rows.append({"bytes": size, "us_per_call": us, "gb_per_s": size / us / 1e3})
    if rank == 0:
        proto = os.environ.get("NCCL_PROTO", "default")
        record = {"world": dist.get_world_size(), "peer_access": peer, "nccl_proto": proto,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows,
                  "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))}}
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"allreduce-{proto}.json").write_text(json.dumps(record, indent=1))
        print(f"peer access {peer}, NCCL {record['nccl']}, proto {proto}")
        for row in rows:
            print(f"  {row['bytes']:>9,d} B: {row['us_per_call']:7.1f} us/call ({row['gb_per_s']:.1f} GB/s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
