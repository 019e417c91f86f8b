"""What a prepared folder's manifest.json must hold for `attnzoo-data info`, `data=shards` and a rerun of
`attnzoo-data prepare` to read it (the rest is a record): each field's kind, checked before any of them reads it
(a hand-edited or truncated manifest was a KeyError / TypeError traceback)."""
from __future__ import annotations

from typing import Optional

_COUNT = ("an integer >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
_TEXT = ("a string", lambda v: isinstance(v, str))
_NUMBER = ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_SPLIT = {"dir": _TEXT, "tokens": _COUNT, "documents": _COUNT}
_SOURCE = {"path": _TEXT, "fingerprint": _TEXT}
# what `info`, `data=shards` and a rerun of prepare read of a manifest (the rest is a record)
MANIFEST_SHAPE = {
    "source": {**_SOURCE, "files": _COUNT, "text_field": _TEXT},
    "tokenizer": {"kind": _TEXT, "file": _TEXT, "sha256": _TEXT, "vocab_size": ("an integer >= 1", lambda v:
                  isinstance(v, int) and not isinstance(v, bool) and v >= 1), "eos_id": _COUNT},
    "dtype": ("uint16 or uint32", lambda v: v in ("uint16", "uint32")),
    "val": {"fraction": _NUMBER, "seed": _NUMBER},
    "splits": {"train": _SPLIT, "val": _SPLIT},
}
PREPARED_WITH = {"prepare": {"source": _SOURCE, "tokenizer": {}, "layout": {}}}  # a rerun of prepare compares it


def manifest_damage(m: dict, shape: dict = MANIFEST_SHAPE, at: str = "") -> Optional[str]:
    """The first field of `m` that is not what `shape` says (missing, or of another kind), as text; None if none
    (was: a KeyError or TypeError traceback from info or data=shards on a hand-edited or truncated manifest)."""
    for key, want in shape.items():
        where = f"{at}{key}"
        if key not in m:
            return f"{where} is missing"
        value = m[key]
        if isinstance(want, dict):
            if not isinstance(value, dict):
                return f"{where} is {value!r}, not a mapping"
            inner = manifest_damage(value, want, f"{where}.")
            if inner:
                return inner
        elif not want[1](value):
            return f"{where} is {value!r}, not {want[0]}"
    tok = m["tokenizer"] if shape is MANIFEST_SHAPE else None
    if tok is not None and tok["eos_id"] >= tok["vocab_size"]:
        return f"tokenizer.eos_id {tok['eos_id']} is outside the vocabulary of {tok['vocab_size']} ids"
    return None


