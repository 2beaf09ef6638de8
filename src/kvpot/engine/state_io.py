"""Prefilled states on disk: one safetensors file, its JSON metadata in the file's header.

A state is a `PotCache` (per layer: the live part of the keys, values, original and RoPE
positions, and the method's per-entry scores), the method's per-run state
(`PotCache.method_state`: tensors, numbers, nested dicts and lists, CItruS' linked instruction
cache), the logits after the last token, the next stream position and the prefill's `Stats`.
Tensors go into safetensors (no pickle anywhere); everything else is JSON in the header's
`__metadata__["kvpot"]`, with a format version, the model's fingerprint, the method's
configuration and a SHA-256 over the metadata and every tensor's bytes.

`PotCache.attention` (InfiniteHiP's sparse-attention runtime) is not saved: `Method.begin`
rebuilds it whenever a state is resumed, so a saved one would be replaced anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import torch

from kvpot.cache import PotCache, PotLayer
from kvpot.errors import KvpotError
from kvpot.host_memory import empty_buffer
from kvpot.models.parallel import TensorParallel, local_tensor
from kvpot.positions import make_policy

FORMAT = "kvpot-state"
VERSION = 1
_PROBES = 4096  # elements per parameter that the model fingerprint hashes
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_fingerprint(model) -> dict:
    """What a state must match to be resumed: architecture, config, dtype and a weight sample
    (computed once per model object; weights changed in place afterwards are not noticed).

    Hashing every weight of an 8B model would take longer than prefilling; the first and last
    `_PROBES` elements of the embeddings, the first layer's parameters and the final norm tell
    checkpoints of one architecture apart (fine-tunes, random seeds) at no cost.
    """
    known = _FINGERPRINTS.get(model)
    if known is not None:
        return known
    config = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "_attn_implementation",
                "_attn_implementation_internal", "use_cache", "attn_implementation"):
        config.pop(key, None)
    params = dict(model.named_parameters())
    names = sorted(params)
    sample = [names[0], *[n for n in names if ".0." in n or "layers.0" in n][:8], names[-1]]
    digest = hashlib.sha256()
    for name in dict.fromkeys(sample):
        digest.update(name.encode())
        if params[name].is_meta:  # offloaded by accelerate (weights on disk or elsewhere): its shape only
            digest.update(str(tuple(params[name].shape)).encode())
            continue
        flat = local_tensor(params[name].detach()).reshape(-1)
        probe = torch.cat([flat[:_PROBES], flat[-_PROBES:]]).float().cpu()
        digest.update(probe.numpy().tobytes())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    _FINGERPRINTS[model] = {
        "architecture": type(model).__name__,
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "weights": digest.hexdigest()[:16],
        "dtype": dtype,
    }
    parallel = TensorParallel.of(model)
    if parallel is not None:  # a rank's state holds its own KV heads: it resumes on the same rank of the same split
        _FINGERPRINTS[model]["tensor_parallel"] = f"rank {parallel.rank} of {parallel.size}"
    return _FINGERPRINTS[model]


def normalized(value):
    """`value` as it reads back from JSON (tuples become lists), for comparisons with saved ones."""
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------------------- writing


class _Writer:
    """Collects tensors under unique names while the metadata is built."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def add(self, name: str, tensor: torch.Tensor) -> dict:
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in self._storages or tensor.numel() == 0:
            tensor = tensor.clone()  # safetensors refuses tensors that share memory
        self._storages.add(tensor.untyped_storage().data_ptr())
        self.tensors[name] = tensor
        return {"tensor": name}

    def cache(self, cache: PotCache, prefix: str, seen: dict[int, str]) -> dict:
        seen[id(cache)] = prefix
        layers = []
        for layer in cache.layers:
            entry = {"n": layer.n, "max_rope": layer.max_rope, "initialized": bool(layer.is_initialized)}
            if layer.is_initialized:
                entry.update(capacity=layer.capacity, scores=sorted(layer.scores))
                at = f"{prefix}.{layer.layer_idx}"
                for name in ("keys", "values", "positions", "rope_positions"):
                    self.add(f"{at}.{name}", getattr(layer, name)[:, :, : layer.n])
                for name in entry["scores"]:
                    self.add(f"{at}.score.{name}", layer.scores[name][:, :, : layer.n])
            layers.append(entry)
        linked = cache.linked
        return {
            "layers": layers, "capacity_hint": cache.capacity_hint, "host_storage": cache.host_storage,
            "max_entries": cache.max_entries, "policy": cache.policy.name,
            "method_state": {k: self.value(v, f"{prefix}.state.{k}", seen) for k, v in cache.method_state.items()},
            "linked": seen.get(id(linked)) if linked is not None else None,
        }

    def value(self, value, name: str, seen: dict[int, str]) -> dict:
        """Method state as tagged JSON: tensors by name, caches nested, containers recursively."""
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        if isinstance(value, torch.Tensor):
            return self.add(name, value)
        if isinstance(value, PotCache):
            if id(value) in seen:
                return {"same_cache": seen[id(value)]}
            return {"cache": self.cache(value, name, seen)}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [self.value(v, f"{name}.{i}", seen) for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {"dict": [[self.value(k, f"{name}.k{i}", seen), self.value(v, f"{name}.{i}", seen)]
                             for i, (k, v) in enumerate(value.items())]}
        raise KvpotError(f"cannot save this state: its method keeps a {type(value).__name__} ({name!r}), "
                         "which kvpot has no file format for.")


def checksum(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the metadata (without its checksum) and each tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "checksum"},
                                       sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save(path, cache: PotCache | None, next_position: int, last_logits: torch.Tensor, method_config: dict,
         stats: dict, model: dict | None, extra: dict | None = None) -> int:
    """Write a state to `path` (atomically: a temporary file, then a rename); returns its size in bytes."""
    from safetensors.torch import save_file

    if cache is None:
        raise KvpotError("this state was spent by generate(..., keep_state=False); there is nothing to save.")
    if model is None:
        raise KvpotError("this state does not say which model made it (built outside Engine); cannot save it.")
    writer = _Writer()
    meta = {
        "format": FORMAT, "version": VERSION, "model": model, "method_config": normalized(method_config),
        "next_position": int(next_position), "stats": normalized(stats), "extra": normalized(extra or {}),
        "cache": writer.cache(cache, "cache", {}),
        "last_logits": writer.add("last_logits", last_logits),
    }
    meta["checksum"] = checksum(meta, writer.tensors)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(writer.tensors, str(tmp), metadata={"kvpot": json.dumps(meta)})
        os.replace(tmp, path)
    except OSError as err:
        raise KvpotError(f"cannot write the state to {path}: {err}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


# ---------------------------------------------------------------------------- reading


def read_metadata(path) -> dict:
    """The JSON metadata of a state file, without reading its tensors."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise KvpotError(f"no state file at {path}.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = (handle.metadata() or {}).get("kvpot")
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged headers
        raise KvpotError(f"{path} is not a kvpot state file ({err}).") from None
    try:
        meta = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise KvpotError(f"{path} is not a kvpot state file (no kvpot metadata).")
    if meta.get("version") != VERSION:
        raise KvpotError(f"{path} is a version {meta.get('version')} kvpot state; this kvpot reads version {VERSION}.")
    return meta


def check_compatible(meta: dict, path, model: dict, method_config: dict) -> None:
    """Refuse a state made with another model or method, saying which differs."""
    if meta["model"] != model:
        raise KvpotError(f"{path} was prefilled by another model ({meta['model']}); this engine runs {model}.")
    if meta["method_config"] != normalized(method_config):
        raise KvpotError(f"{path} was prefilled with {meta['method_config']}, but the engine runs "
                         f"{normalized(method_config)}; load it into an engine with that method.")


def load(path, engine) -> dict:
    """Read a state for `engine`: checks format, checksum, model and method; returns State's fields."""
    from safetensors.torch import load_file

    meta = read_metadata(path)
    check_compatible(meta, path, model_fingerprint(engine.model), engine.method.config())
    try:
        tensors = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - as above: any failure to read is a damaged file
        raise KvpotError(f"cannot read the tensors of {path} ({err}).") from None
    if checksum(meta, tensors) != meta.get("checksum"):
        raise KvpotError(f"{path} is damaged: its checksum does not match its contents.")
    reader = _Reader(tensors, engine)
    cache = reader.cache(meta["cache"])
    return {
        "cache": cache, "next_position": meta["next_position"],
        "last_logits": tensors["last_logits"].to(engine.device), "stats": meta["stats"],
        "extra": meta.get("extra", {}),
    }


class _Reader:
    def __init__(self, tensors: dict[str, torch.Tensor], engine):
        self.tensors, self.engine = tensors, engine
        self.caches: dict[str, PotCache] = {}
        self.links: list[tuple[PotCache, str]] = []

    def cache(self, meta: dict, name: str = "cache") -> PotCache:
        engine = self.engine
        if len(meta["layers"]) != engine.model.config.num_hidden_layers:
            raise KvpotError(f"the state has {len(meta['layers'])} layers; the model has "
                             f"{engine.model.config.num_hidden_layers}.")
        cache = PotCache(len(meta["layers"]), engine.rope, make_policy(meta["policy"]), meta["capacity_hint"])
        cache.parallel = engine.parallel
        cache.host_storage = meta["host_storage"]
        cache.max_entries = meta["max_entries"]
        self.caches[name] = cache
        for layer, entry in zip(cache.layers, meta["layers"]):
            self.layer(layer, entry, f"{name}.{layer.layer_idx}")
        cache.method_state = {k: self.value(v, f"{name}.state.{k}") for k, v in meta["method_state"].items()}
        if meta.get("linked"):
            self.links.append((cache, meta["linked"]))
        if name == "cache":  # the outermost cache: every nested one exists now
            for owner, target in self.links:
                owner.linked = self.caches[target]
        return cache

    def layer(self, layer: PotLayer, entry: dict, at: str) -> None:
        layer.set_counts(entry["n"], entry["max_rope"])
        if not entry["initialized"]:
            return
        keys, values = self.tensors[f"{at}.keys"], self.tensors[f"{at}.values"]
        device, cache = self.engine.device, layer.cache
        host = cache.host_storage and device.type == "cuda"  # offloaded entries live in pinned host memory
        layer.batch, layer.kv_heads, _, layer.head_dim = keys.shape
        layer.dtype, layer.device = keys.dtype, device
        capacity = max(entry["capacity"], layer.n, 1)

        def place(saved: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            buf = empty_buffer((*saved.shape[:2], capacity, *saved.shape[3:]), dtype, device, host)
            buf[:, :, : layer.n] = saved
            return buf

        layer.keys, layer.values = place(keys, keys.dtype), place(values, values.dtype)
        layer.positions = place(self.tensors[f"{at}.positions"], torch.long)
        layer.rope_positions = place(self.tensors[f"{at}.rope_positions"], torch.long)
        layer.scores = {}
        for name in entry["scores"]:
            saved = self.tensors[f"{at}.score.{name}"]
            score = torch.zeros((*saved.shape[:2], capacity), dtype=torch.float32, device=device)
            score[:, :, : layer.n] = saved
            layer.scores[name] = score
        layer.is_initialized = True

    def value(self, tagged: dict, name: str):
        if "value" in tagged:
            return tagged["value"]
        if "tensor" in tagged:
            return self.tensors[tagged["tensor"]].to(self.engine.device)
        if "cache" in tagged:
            return self.cache(tagged["cache"], name)
        if "same_cache" in tagged:
            return self.caches[tagged["same_cache"]]
        if "list" in tagged or "tuple" in tagged:
            items = [self.value(v, f"{name}.{i}") for i, v in enumerate(tagged.get("list", tagged.get("tuple")))]
            return items if "list" in tagged else tuple(items)
        if "dict" in tagged:
            return {self.value(k, f"{name}.k{i}"): self.value(v, f"{name}.{i}")
                    for i, (k, v) in enumerate(tagged["dict"])}
        raise KvpotError(f"unknown entry in a state file's method state: {sorted(tagged)}.")


def state_nbytes(cache: PotCache | None, last_logits: torch.Tensor | None = None) -> int:
    """Bytes a state holds: every buffer of every layer (allocated capacity), scores and method tensors."""
    if cache is None:
        return 0
    seen: set[int] = set()

    def count(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, PotCache):
            if id(value) in seen:
                return 0
            seen.add(id(value))
            total = sum(count(v) for v in value.method_state.values())
            for layer in value.layers:
                if layer.is_initialized:
                    total += sum(count(b) for b in (layer.keys, layer.values, layer.positions, layer.rope_positions))
                    total += sum(count(s) for s in layer.scores.values())
            return total
        if isinstance(value, (list, tuple)):
            return sum(count(v) for v in value)
        if isinstance(value, dict):
            return sum(count(v) for v in value.values())
        return 0

    return count(cache) + (count(last_logits) if last_logits is not None else 0)
