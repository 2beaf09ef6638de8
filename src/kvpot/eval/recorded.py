"""Recorded files read back however records/ stores them (issue 44): plain, gzip-compressed, or packed.

- plain: `FOLDER/results.json`, as the run wrote it;
- compressed: `FOLDER/results.json.gz` holds what `FOLDER/results.json` held (`zcat` reads it);
- packed: a folder's `results.jsonl.gz` whose every line names the file it came from, relative to that
  folder: `{"file": "passkey-8k/config.json", "json": {...}}` for a JSON file, and one
  `{"file": "passkey-8k/results.jsonl", "row": {...}}` per row of a JSONL file, in order (a file that is not
  clean JSON, e.g. a JSONL file with a console line appended, is kept whole: `{"file": ..., "text": "..."}`,
  and read back as the plain file would be). Many small run
  folders are kept this way so records/ stays a few hundred files; the former paths still name them:
  `zcat FOLDER/results.jsonl.gz | jq -c 'select(.file == "passkey-8k/config.json") | .json'`.

Callers ask for the former path (`records/reference-model/passkey-8k/config.json`) and get the same data
whichever way it is stored; `files(root, "config.json")` lists every such path below a folder.
"""

from __future__ import annotations

import copy
import gzip
import json
from functools import lru_cache
from pathlib import Path

from kvpot.errors import KvpotError

PACK = "results.jsonl.gz"


def read_text(path: Path) -> str:
    """A plain or gzip-compressed (`.gz` in its name) file's text."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return handle.read()
    return path.read_text(encoding="utf-8")


class Verbatim(str):
    """A packed file kept as its text (it is not clean JSON / JSONL)."""


def pack_lines(entries: dict[str, object]) -> list[str]:
    """The lines of a pack of `entries` (relative path -> parsed JSON, a list of rows for `.jsonl`, or Verbatim)."""
    lines = []
    for name, data in entries.items():
        if isinstance(data, Verbatim):
            lines.append(json.dumps({"file": name, "text": str(data)}))
        elif name.endswith(".jsonl"):
            lines += [json.dumps({"file": name, "row": row}) for row in data]
        else:
            lines.append(json.dumps({"file": name, "json": data}))
    return lines


@lru_cache(maxsize=64)
def _pack(path: str, stamp: int) -> dict[str, object] | None:
    """The entries of a pack (`stamp`: its mtime, so a rewritten pack is read again); None if `path` is a
    compressed results.jsonl of one run (its lines carry no `file`)."""
    entries: dict[str, object] = {}
    for line in read_text(Path(path)).splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or "file" not in item:
            return None
        if "row" in item:
            entries.setdefault(item["file"], []).append(item["row"])
        elif "text" in item:
            entries[item["file"]] = Verbatim(item["text"])
        else:
            entries[item["file"]] = item["json"]
    return entries


def _entries(folder: Path) -> dict[str, object]:
    pack = folder / PACK
    if not pack.is_file():
        return {}
    return _pack(str(pack), pack.stat().st_mtime_ns) or {}


def _packed(path: Path) -> object | None:
    """The data of `path` from the nearest pack above it that holds it (a copy: packs are cached), or None."""
    for folder in path.parents:
        data = _entries(folder).get(path.relative_to(folder).as_posix())
        if data is not None:
            return data if isinstance(data, Verbatim) else copy.deepcopy(data)
    return None


def _plain(path: Path) -> Path | None:
    """The file on disk that holds `path` itself: `path`, or `path.gz` unless that is a pack."""
    if path.is_file():
        return path
    compressed = path.with_name(path.name + ".gz")
    if compressed.is_file() and not (compressed.name == PACK and _entries(path.parent)):
        return compressed
    return None


def exists(path: Path) -> bool:
    """Whether `path` is a recorded file: plain, compressed or packed."""
    path = Path(path)
    return _plain(path) is not None or _packed(path) is not None


def is_dir(path: Path) -> bool:
    """Whether `path` is a folder on disk or a folder that packed files sit in."""
    path = Path(path)
    if path.is_dir():
        return True
    for folder in path.parents:
        prefix = path.relative_to(folder).as_posix() + "/"
        if any(name.startswith(prefix) for name in _entries(folder)):
            return True
    return False


def read_json(path: Path):
    """A recorded JSON file's data."""
    path = Path(path)
    plain = _plain(path)
    data = read_text(plain) if plain is not None else _packed(path)
    if data is None:
        raise KvpotError(f"no recorded file {path} (plain, .gz or in a folder's {PACK} above it).")
    if not isinstance(data, str):
        return data
    try:
        return json.loads(data)
    except ValueError as error:
        raise KvpotError(f"{path} is not readable JSON ({error}).") from None


def read_jsonl(path: Path) -> list:
    """A recorded JSONL file's rows, blank lines skipped."""
    path = Path(path)
    plain = _plain(path)
    data = read_text(plain) if plain is not None else _packed(path)
    if data is None:
        raise KvpotError(f"no recorded file {path} (plain, .gz or in a folder's {PACK} above it).")
    if not isinstance(data, str):
        return data
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def paths(root: Path) -> list[Path]:
    """Every recorded file at or below `root`, sorted: files on disk (a compressed one also under the name
    it holds, without `.gz`) and the packed files by their former paths."""
    root = Path(root)
    found = set()
    for path in root.rglob("*"):
        if path.name == PACK and _entries(path.parent):
            found |= {path.parent / entry for entry in _entries(path.parent)}
        elif path.is_file():
            found |= {path, path.with_name(path.name[:-3])} if path.suffix == ".gz" else {path}
    for folder in root.parents:  # `root` may itself lie inside a pack
        prefix = root.relative_to(folder).as_posix() + "/"
        found |= {folder / entry for entry in _entries(folder) if entry.startswith(prefix)}
    return sorted(found)


def files(root: Path, name: str) -> list[Path]:
    """Every recorded file called `name` at or below `root` (plain, compressed or packed), sorted."""
    return [path for path in paths(root) if path.name == name]
