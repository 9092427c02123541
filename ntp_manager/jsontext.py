"""JSON text made in pieces, and the fast encoding and parsing of the fleet's hot rows. The REST
edge answers with it and the store writes it (store/db.py's serializer), so it sits below both: the
edge need not reach into the store for it (issue 35).

`parse` is orjson where it gives exactly what the standard library gives, and the standard library
where it would not: the outbox rows the leader reads and the world-log rows every other manager
follows are most of their JSON parsing (bench/RESULTS.md), and orjson parses several times faster."""

from __future__ import annotations

import json
from typing import Any

import orjson

CHUNK = 256


def dumps_in_pieces(obj: Any, sort_keys: bool = False) -> str:
    """`json.dumps(obj)` (compact, finite numbers only), made piece by piece: dicts key by key and
    long lists `CHUNK` items at a time. The C encoder holds the GIL for a whole call, so one call
    over a 100K-GPU plan would stop the event loop for as long as it runs even from a worker
    thread; between pieces the loop gets its turn."""
    if isinstance(obj, dict):
        keys = sorted(obj) if sort_keys else list(obj)
        parts = [json.dumps(_key(k)) + ":" + dumps_in_pieces(obj[k], sort_keys) for k in keys]
        return "{" + ",".join(parts) + "}"
    if isinstance(obj, list | tuple) and len(obj) > CHUNK:
        pieces = [json.dumps(obj[i : i + CHUNK], allow_nan=False, separators=(",", ":"), sort_keys=sort_keys)[1:-1]
                  for i in range(0, len(obj), CHUNK)]
        return "[" + ",".join(p for p in pieces if p) + "]"
    return json.dumps(obj, allow_nan=False, separators=(",", ":"), sort_keys=sort_keys)


def _key(k: Any) -> str:
    """A dict key as `json.dumps` writes it."""
    if isinstance(k, str):
        return k
    if k is True or k is False or k is None:
        return json.dumps(k)
    return json.dumps(k) if isinstance(k, int | float) else str(k)


class StoredJson(dict[str, Any]):
    """A JSON document with its text made once, where it was built (off the event loop for
    plans); the store's serializer (store/db.py `json_text`) writes that text instead of encoding
    the dict again."""

    __slots__ = ("text",)

    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__(doc)
        self.text = dumps_in_pieces(doc)


# bytes: every digit to "9", anything else to a space; then a run of 19 nines is a run of 19 digits
# (2**63 has 19): C-speed, where a regular expression took longer than the parse itself
_DIGITS = bytes(0x39 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"9" * 19


def parse(text: str) -> Any:
    """`json.loads(text)`: orjson, and the standard library where orjson would not give the same:
    a text with a run of 19 or more digits (orjson reads an integer beyond 64 bits as a float,
    silently; the run may as well be inside a string, which only costs the slower parser) and
    what orjson refuses (NaN and Infinity tokens), so that the result and the errors are the
    standard library's."""
    if _LONG_RUN in text.encode().translate(_DIGITS):
        return json.loads(text)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
