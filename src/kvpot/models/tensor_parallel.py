"""Loading a model with transformers' own tensor-parallel plan, under torchrun.

`from_pretrained(distributed_config=DistributedConfig(tp_size=N))` initialises torch.distributed itself from
torchrun's environment (NCCL on CUDA with rank r bound to cuda:LOCAL_RANK, gloo on a CPU), builds a 1-D mesh
and shards every projection of the architecture's `base_model_tp_plan` (q/k/v/gate/up column-wise,
o/down row-wise, each row-wise output all-reduced); the embeddings, norms and the head stay whole on every
rank. `DistributedConfig(tp_size=N)` is accepted the same way by transformers 5.13 (which then uses the
model's plan, as `tp_plan="auto"`), 5.17 and 5.24; the standalone `tp_plan=` argument is deprecated.

Random-weight benchmark shapes go through the same call: a folder with the shape's config and a weights file
with no tensors, every rank seeded alike, so transformers initialises each rank's shards (and the whole
replicated weights identically) instead of reading them. No 16 GB (8B) or 140 GB (70B) of random weights is
ever written to disk, and the model is sharded by the same code as a checkpoint.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kvpot.errors import KvpotError
from kvpot.models.parallel import check_heads, check_world


def tp_device_type() -> str:
    """Where transformers puts each rank: its accelerator (cuda:LOCAL_RANK), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_tp(config, tp_size: int, device: str | None, device_map) -> None:
    """Refuse what tensor parallelism cannot do here, before any weight is read."""
    check_world(tp_size)
    if device_map is not None:
        raise KvpotError("give either tp_size (tensor parallelism, one rank per GPU) or a device_map (layers "
                         "split over the GPUs of one process), not both.")
    expected = tp_device_type()
    if device is not None and torch.device(device).type != expected:
        raise KvpotError(f"under tensor parallelism transformers places each rank on {expected} "
                         f"({'cuda:LOCAL_RANK' if expected == 'cuda' else 'gloo on the CPU'}); "
                         f"drop --device {device} or give {expected}.")
    if not config.base_model_tp_plan:
        raise KvpotError(f"{type(config).__name__} has no tensor-parallel plan in transformers; split it over "
                         "GPUs with device_map='auto' (--device-map auto) instead.")
    check_heads(config, tp_size)


def load_tensor_parallel(source: str, tp_size: int, dtype: torch.dtype):
    """`source` (a local folder or Hub id) sharded over the `tp_size` ranks of this torchrun, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype,
                                                 distributed_config=DistributedConfig(tp_size=tp_size))
    if (getattr(model, "tp_size", None) or 1) != tp_size:
        raise KvpotError(f"transformers did not shard {type(model).__name__} over {tp_size} ranks "
                         f"(tp_size {model.tp_size}).")
    return model.eval()


def build_tensor_parallel(config, tp_size: int, dtype: torch.dtype, seed: int = 0):
    """A random-weight model of `config` sharded over the `tp_size` ranks of this torchrun (benchmark shapes)."""
    from safetensors.torch import save_file

    check_tp(config, tp_size, None, None)
    with tempfile.TemporaryDirectory(prefix="kvpot-tp-shape-") as folder:
        config.save_pretrained(folder)
        save_file({}, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
        # the same seed on every rank: replicated weights (embeddings, norms, head) are drawn alike everywhere
        torch.manual_seed(seed)
        from transformers.utils import logging

        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # every weight is "missing" from the empty file, on purpose
        try:
            return load_tensor_parallel(folder, tp_size, dtype)
        finally:
            logging.set_verbosity(verbosity)
