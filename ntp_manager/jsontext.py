"""JSON text made in pieces (standard library only). The REST edge answers with it and the store
writes it (store/db.py's serializer), so it sits below both: the edge need not reach into the store
for it (issue 35)."""

from __future__ import annotations

import json
from typing import Any

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
