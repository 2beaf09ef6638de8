"""Page-locked host memory for offloaded caches (InfiniteHiP, InfLLM): buffers that GPU kernels read
and write directly over the bus, allocated at exactly their size."""

from __future__ import annotations

import math
import mmap

import torch

from kvpot.errors import KvpotError


def empty_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, host: bool) -> torch.Tensor:
    """A buffer on `device`, or with `host`, in page-locked host memory of exactly its size."""
    if not host:
        return torch.empty(shape, dtype=dtype, device=device)
    return host_empty(shape, dtype)


def on_host(buf: torch.Tensor, device: torch.device) -> bool:
    """Whether a layer on `device` keeps `buf` in host memory (offloading)."""
    return buf.device.type == "cpu" and device.type == "cuda"


def store_on_host(layer, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor,
                  rope_position: torch.Tensor) -> None:
    """A fixed-shape step's entry ([1, kv, 1, d] rows, [1, kv, 1] positions) written at `layer.slot` of its
    host buffers by one kernel: no host synchronisation, so the step can be captured."""
    from kvpot.kernels.hip import store_entry

    if layer.batch != 1:
        raise KvpotError("offloaded buffers hold one sequence (batch 1).")
    with torch.cuda.device(layer.device):  # Triton launches on the current device
        store_entry(layer.keys[0], layer.values[0], layer.positions[0], layer.rope_positions[0], layer.slot,
                    key[0, :, 0], value[0, :, 0], position[0, :, 0], rope_position[0, :, 0])


def copy_buffer(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy that stays in page-locked memory when `buf` is (kernels read it directly)."""
    if not on_host(buf, device):
        return buf.clone()
    return empty_buffer(tuple(buf.shape), buf.dtype, buf.device, True).copy_(buf)


def grow_buffer(buf: torch.Tensor, capacity: int, used: int, device: torch.device) -> torch.Tensor:
    new = empty_buffer((*buf.shape[:2], capacity, *buf.shape[3:]), buf.dtype, buf.device, on_host(buf, device))
    new[:, :, :used] = buf[:, :, :used]
    return new


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class _LockedPages(mmap.mmap):
    """Anonymous host pages, page-locked for the GPU (`cudaHostRegister`) for as long as they live."""

    address = 0

    def __del__(self):
        if self.address:  # the last tensor on these pages is gone: unlock before the pages are unmapped
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.address = 0


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in page-locked memory that GPU kernels read directly, of exactly
    its size. (`pin_memory=True` goes through torch's pinned-memory cache, which rounds every block
    up to a power of two: one llama3-8b layer's keys for 512K tokens plus a few new ones, 1 GiB +
    2 MiB, would take 2 GiB, and the whole cache 128 GiB instead of 64.)"""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    pages = _LockedPages(-1, nbytes)
    flat = torch.frombuffer(pages, dtype=torch.uint8)  # keeps `pages` alive as long as its storage
    # cudaHostRegisterPortable: pinned for every GPU's context, so a model split over GPUs reads it from each
    error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
    if error:
        raise KvpotError(f"infinitehip: could not page-lock {nbytes / 2**30:.2f} GiB of host memory for offloading "
                         f"(cudaHostRegister error {error}); free host memory or shorten the context.")
    pages.address = flat.data_ptr()
    return flat.view(dtype).view(shape)
