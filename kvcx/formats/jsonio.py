"""JSON read strictly and written atomically: packed files' metadata, metadata sidecars, plans.

Strict means: no duplicate keys, nesting bounded, and the value checked by the caller's schema; every
error names the file or key and says how to fix it.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from kvcx.errors import FormatError
from kvcx.formats.atomic import open_regular, write_bytes_to

# nesting deeper than this in any metadata JSON is refused (a real sidecar is a few levels deep)
MAX_JSON_DEPTH = 64
SIDECAR_SUFFIX = ".metadata.json"


def check_text(obj, where: str) -> None:
    """FormatError if any string in ``obj`` (keys included, nested) is not valid Unicode (a lone surrogate
    such as ``"\\ud800"`` is legal JSON but cannot be written as UTF-8): kvcx refuses what it could not
    write back."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                raise FormatError(f"{where}: the text {o[:40]!r} holds a lone surrogate, which is not valid UTF-8 and "
                                  "cannot be written back; fix the text") from None
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def no_duplicate_keys(pairs):
    """``object_pairs_hook`` for json.loads: a dict, or FormatError on a repeated key."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _depth(obj, limit: int) -> bool:
    """Whether obj nests no deeper than ``limit`` (iterative: deep input cannot exhaust the stack)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return False
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return True


def loads_strict(text: str, where: str, fix: str):
    """JSON with no duplicate keys and bounded nesting, else FormatError('{where} ...; {fix}')."""
    try:
        value = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except RecursionError:
        raise FormatError(f"{where} nests too deeply; {fix}") from None
    except ValueError as exc:
        raise FormatError(f"{where} is not valid JSON ({str(exc)[:80]}); {fix}") from None
    if not _depth(value, MAX_JSON_DEPTH):
        raise FormatError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels; {fix}")
    check_text(value, where)
    return value


def read_json_object(p: str, what: str, fix: str) -> dict:
    """A JSON object from file ``p``, parsed strictly; FormatError('{p}: {what} ...; {fix}') otherwise."""
    with open_regular(p, what[4:] if what.startswith("the ") else what) as fh:
        try:
            text = fh.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FormatError(f"{p}: cannot read {what} ({exc}); {fix}") from None
    data = loads_strict(text, f"{p}: {what}", fix)
    if not isinstance(data, dict):
        raise FormatError(f"{p}: {what} must be a JSON object; {fix}")
    return data


def write_json_to(tmp: str, target: str, data: dict) -> None:
    """Write ``data`` as indented JSON to ``tmp``, the temporary file of ``target`` (part of an OutputSet)."""
    write_bytes_to(tmp, target, [json.dumps(data, indent=2, sort_keys=True).encode("utf-8")])


def sidecar_path(path) -> str:
    """``<path>.metadata.json``: the metadata sidecar beside a KV-cache file."""
    return os.fspath(path) + SIDECAR_SUFFIX


def read_sidecar(path) -> Optional[dict]:
    """The sidecar of ``path`` as a JSON object, or None when there is none."""
    p = sidecar_path(path)
    if not os.path.exists(p):
        return None
    return read_json_object(p, "the metadata sidecar", "fix or remove it")
