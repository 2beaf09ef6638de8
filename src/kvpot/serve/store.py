"""Prefilled states by key: in memory up to a byte budget (LRU out), spilled to a directory.

Keys are content hashes (`state_key`): the model's fingerprint, the method's configuration and
the context's token ids, so an uploaded document and a chat whose first user message is the
same text share one state, and a restarted server finds its files again. Documents are written
through to the directory when they are stored; conversation contexts only when memory evicts
them. Torch work (saving, loading) happens on the caller's thread, which in the server is the
one generation thread; the index itself is guarded by a lock for the HTTP side.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from kvpot.errors import KvpotError

log = logging.getLogger("kvpot.serve")
_KEY = re.compile(r"[0-9a-f]{32}")  # what `state_key` makes


class DamagedState(KvpotError):
    """A stored state's file failed its checks when loaded: the server's fault, not the client's. The file is
    set aside (renamed `*.damaged`, out of the listing) and the message names no path."""


def state_key(fingerprint: dict, method_config: dict, ids: list[int]) -> str:
    from kvpot.engine.state_io import normalized

    digest = hashlib.sha256(json.dumps([fingerprint, normalized(method_config)], sort_keys=True).encode())
    digest.update(b"|" + ",".join(map(str, ids)).encode())
    return digest.hexdigest()[:32]


@dataclass
class Entry:
    """What the store knows about one state, in memory or on disk."""

    key: str
    kind: str  # "document" (uploaded) or "context" (a conversation's first message)
    spec: str  # the method spec the state was read with
    context_tokens: int
    kv_entries: int  # entries each layer keeps per KV head after reading
    max_kv_entries: int
    prefill_seconds: float
    nbytes: int  # memory the state takes when loaded
    created: float
    state: object | None = None  # kvpot.State while in memory
    disk_bytes: int = 0  # size of its file; 0 when not on disk
    questions: int = 0  # generations answered from it since this server started
    last_used: float = field(default_factory=time.time)

    @property
    def id(self) -> str:
        return f"doc-{self.key}"

    def describe(self) -> dict:
        where = [w for w, here in (("memory", self.state is not None), ("disk", self.disk_bytes > 0)) if here]
        return {"id": self.id, "object": "document", "kind": self.kind, "created": int(self.created),
                "method": self.spec, "context_tokens": self.context_tokens, "kept_kv_entries": self.kv_entries,
                "max_kv_entries": self.max_kv_entries, "seconds": round(self.prefill_seconds, 4),
                "reads": 1, "questions": self.questions, "bytes": self.nbytes, "stored_in": where}


class StateStore:
    """LRU over states: `memory` bytes in memory, then `directory` (up to `disk` bytes, if given)."""

    def __init__(self, memory: int, directory: Path | None = None, disk: int | None = None, shared: bool = False):
        self.memory, self.directory, self.disk = memory, directory, disk
        # several servers (Ray Serve replicas) read and write the directory: a document another one stored is
        # found there on demand, and one whose file is gone (deleted through another replica) is forgotten
        self.shared = shared and directory is not None
        self.fingerprint: dict | None = None  # the model's, set by `scan`
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.lock = threading.RLock()

    # ---------------------------------------------------------------- index
    def scan(self, fingerprint: dict) -> int:
        """Index the state files of this model in the directory (after a restart); returns how many."""
        self.fingerprint = fingerprint
        if self.directory is None:
            return 0
        found = [e for path in self.directory.glob("*.safetensors") if (e := self._indexed(path)) is not None]
        with self.lock:
            for entry in sorted(found, key=lambda e: e.last_used):
                self.entries.setdefault(entry.key, entry)  # one known already (a shared rescan) keeps its state
        return len(found)

    def _indexed(self, path: Path) -> Entry | None:
        """The entry of a state file of this model written by a kvpot server, else None (logged if unreadable)."""
        from kvpot.engine.state_io import read_metadata

        try:
            meta = read_metadata(path)
            disk_bytes, mtime = path.stat().st_size, path.stat().st_mtime
        except KvpotError as err:
            log.warning("ignoring %s: %s", path, err)
            return None
        except OSError:
            return None  # removed meanwhile (another replica deleted it)
        extra, stats = meta.get("extra", {}), meta.get("stats", {})
        if meta["model"] != self.fingerprint or "kind" not in extra:
            return None  # another model's state, or not one this server wrote
        return Entry(path.stem, extra["kind"], extra["spec"], stats.get("context_tokens", 0),
                     stats.get("final_kv_entries", 0), stats.get("max_kv_entries", 0), stats.get("prefill_seconds", 0.0),
                     extra.get("nbytes", 0), extra.get("created", 0.0), disk_bytes=disk_bytes, last_used=mtime)

    def _sync(self, key: str) -> None:
        """(shared directory) Agree with the directory about one key: adopt a file another server wrote, forget
        an entry whose file another server deleted."""
        if not _KEY.fullmatch(key):
            return  # not a key this store writes (a client's text: never a path)
        path = self._path(key)
        with self.lock:
            entry = self.entries.get(key)
        if entry is None:
            found = self._indexed(path) if path.exists() else None
            if found is not None:
                with self.lock:
                    self.entries.setdefault(key, found)
        elif entry.disk_bytes and not path.exists():
            with self.lock:
                self.entries.pop(key, None)
            entry.state = None

    def _sync_all(self) -> None:
        """(shared directory) The whole listing against the directory."""
        with self.lock:
            written = [key for key, entry in self.entries.items() if entry.disk_bytes]
        for key in written:
            self._sync(key)
        self.scan(self.fingerprint)

    def lookup(self, key: str) -> Entry | None:
        if self.shared:
            self._sync(key)
        with self.lock:
            return self.entries.get(key)

    def listing(self) -> list[dict]:
        if self.shared:
            self._sync_all()
        with self.lock:
            return [e.describe() for e in reversed(self.entries.values())]

    def totals(self) -> dict:
        with self.lock:
            entries = list(self.entries.values())
        return {"memory_bytes": sum(e.nbytes for e in entries if e.state is not None),
                "disk_bytes": sum(e.disk_bytes for e in entries),
                "memory_states": sum(e.state is not None for e in entries),
                "disk_states": sum(e.disk_bytes > 0 for e in entries), "states": len(entries)}

    def delete(self, key: str) -> bool:
        with self.lock:
            entry = self.entries.pop(key, None)
        if entry is None:
            return False
        entry.state = None
        self._path(key).unlink(missing_ok=True) if self.directory is not None else None
        return True

    # ---------------------------------------------------------------- states
    def get(self, key: str, engine):
        """The state under `key` (loaded from disk if it was spilled), or None if unknown."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.entries.move_to_end(key)
            entry.last_used, entry.questions = time.time(), entry.questions + 1
            state = entry.state
        if state is not None:
            return state
        if not entry.disk_bytes:
            return None
        from kvpot.engine import State

        try:
            state = State.load(self._path(key), engine)
        except KvpotError as err:
            self._set_aside(entry, err)
            raise DamagedState(f"the stored state of {entry.id} is damaged (its file failed kvpot's checks) and was "
                               "removed; upload the document again.") from None
        self._hold(entry, state)
        return state

    def _set_aside(self, entry: Entry, err: Exception) -> None:
        """Take a damaged state out of the listing; its file is kept beside the others as `*.damaged`."""
        with self.lock:
            self.entries.pop(entry.key, None)
        path = self._path(entry.key)
        try:
            path.replace(path.with_name(path.name + ".damaged"))
        except OSError:
            pass  # gone already: nothing to set aside
        log.error("stored state %s is damaged and was set aside as %s.damaged: %s", entry.id, path, err)

    def put(self, key: str, state, kind: str, spec: str) -> Entry:
        """Store a freshly read state. A document that fits nowhere is refused (KvpotError)."""
        stats = state.stats
        entry = Entry(key, kind, spec, stats.context_tokens, stats.final_kv_entries, stats.max_kv_entries,
                      stats.prefill_seconds, state.nbytes, time.time())
        with self.lock:
            old = self.entries.get(key)
            if old is not None:
                if kind == "document":
                    old.kind = "document"
                entry = old
            else:
                self.entries[key] = entry
        if kind == "document" and self.directory is not None and not entry.disk_bytes:
            self._write(entry, state)
        if entry.nbytes > self.memory:
            if not entry.disk_bytes and self.directory is not None:
                self._write(entry, state)
            if not entry.disk_bytes:
                with self.lock:
                    self.entries.pop(key, None)
                if kind == "document":
                    raise KvpotError(f"the document's state takes {entry.nbytes:,} bytes, more than --state-memory "
                                     f"({self.memory:,}); raise it, or give --state-dir to keep states on disk.")
            return entry
        self._hold(entry, state)
        return entry

    def persist(self) -> int:
        """Write every state held only in memory to the directory (a server stopping); returns how many."""
        if self.directory is None:
            return 0
        with self.lock:
            pending = [e for e in self.entries.values() if e.state is not None and not e.disk_bytes]
        for entry in pending:
            self._write(entry, entry.state)
        return len(pending)

    def promote(self, key: str) -> Entry | None:
        """Mark a stored context as an uploaded document (written through to the directory)."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            entry.kind = "document"
            self.entries.move_to_end(key)
            state = entry.state
        if self.directory is not None and state is not None:
            self._write(entry, state)  # rewritten: the file records the kind
        return entry

    def _hold(self, entry: Entry, state) -> None:
        """Keep `state` in memory, spilling (or dropping) the least recently used ones to make room."""
        if entry.nbytes > self.memory:
            return  # read from disk for one use; never held
        while True:
            with self.lock:
                used = sum(e.nbytes for e in self.entries.values() if e.state is not None and e is not entry)
                victims = [e for e in self.entries.values() if e.state is not None and e is not entry]
            if used + entry.nbytes <= self.memory or not victims:
                break
            victim = victims[0]
            if self.directory is not None and not victim.disk_bytes:
                self._write(victim, victim.state)
            with self.lock:
                victim.state = None
                if not victim.disk_bytes:
                    self.entries.pop(victim.key, None)  # nowhere to spill: forgotten
        with self.lock:
            entry.state = state
            self.entries.move_to_end(entry.key)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def _write(self, entry: Entry, state) -> None:
        extra = {"kind": entry.kind, "spec": entry.spec, "created": entry.created, "nbytes": entry.nbytes}
        entry.disk_bytes = state.save(self._path(entry.key), extra=extra)
        if self.disk is None:
            return
        while True:  # the disk budget: drop the least recently used files
            with self.lock:
                on_disk = [e for e in self.entries.values() if e.disk_bytes and e is not entry]
                used = sum(e.disk_bytes for e in on_disk) + entry.disk_bytes
            if used <= self.disk or not on_disk:
                return
            victim = on_disk[0]
            self._path(victim.key).unlink(missing_ok=True)
            with self.lock:
                victim.disk_bytes = 0
                if victim.state is None:
                    self.entries.pop(victim.key, None)
