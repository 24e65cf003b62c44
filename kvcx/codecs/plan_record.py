"""A plan file's record (``kvcx calibrate --out``): every field typed and bounded before a plan is used.

The config inside it is read by :meth:`kvcx.codecs.kvconfig.KVConfig.from_config`; this checks what calibration
recorded around it (the budget, the sensitivity figures, the retrieval guard, the layers and their types).
"""
from __future__ import annotations

import re

from kvcx.codecs.dtypes import is_int
from kvcx.errors import CodecError

MAX_LAYERS = 1 << 16
TAG_RE = re.compile(r"b(1|2|3|4|8)[a-z0-9]*")   # a variant's tag: bN = N bits, then g128 = groups of 128, a =
#                                               asymmetric, w = a width per channel (h: and a half, b2hw = 2.5 bits)

# a plan file: the config and what calibration recorded, each field typed and bounded
_PLAN_NUMBERS = ("budget", "bits_per_value", "wall_time_s", "estimated_kld")
_PLAN_COUNTS = {"n_layers": MAX_LAYERS, "windows": 1 << 31, "tokens": 1 << 48, "extrapolated": 1 << 24,
                "head_dim": 1 << 16}
_PLAN_FIELDS = {"config", "sensitivity", "model", "complete", "steps", "press", "guard", "induction", "layers",
                *_PLAN_NUMBERS,
                *_PLAN_COUNTS}
# the retrieval guard's record (kvcx.quality.guard): numbers, and lists of numbers a layer or a depth each
_GUARD_NUMBERS = {"whole", "protect", "length", "prompts", "seed"}
_GUARD_LISTS = {"layers", "losses", "depths"}
# the induction probe's record (kvcx.quality.induction): its settings, the layers it guarded, each layer's scores
_INDUCTION_NUMBERS = {"tokens", "trials", "seed"}
_KEEP_TAG_RE = re.compile(r"k(1|0?\.[0-9]+)")   # an eviction's keep ratio, as calibration tags it


def _finite_number(v) -> bool:
    import math

    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:   # an integer too large for a float
        return False


def check_plan_record(data, source: str) -> dict:
    """A plan file's JSON (``kvcx calibrate --out``), every field typed and bounded; CodecError naming the file
    and field otherwise. Returns ``data``."""
    def bad(what: str):
        raise CodecError(f"{source}: {what}; the plan is damaged or was not written by `kvcx calibrate`: write it "
                         "again")
    if not isinstance(data, dict):
        bad("a plan must be a JSON object")
    unknown = sorted(set(data) - _PLAN_FIELDS)
    if unknown and "config" in data:
        bad(f"unknown fields {unknown[:5]}")
    cfg = data.get("config", data)
    if not isinstance(cfg, dict):
        bad(f"'config' must be an object, got {type(cfg).__name__}")
    if "config" not in data:
        return data   # a bare config (KVConfig.get_config()): KVConfig.from_config reads it strictly
    for k in _PLAN_NUMBERS:
        v = data.get(k)
        if k == "estimated_kld" and isinstance(v, float) and v != v:   # NaN: not estimated (earlier releases)
            continue
        if v is not None and not _finite_number(v):
            bad(f"'{k}' must be a finite number, got {str(v)[:40]}")
    for k, top in _PLAN_COUNTS.items():
        v = data.get(k)
        if v is not None and not (is_int(v) and 0 <= v <= top):
            bad(f"'{k}' must be a whole number from 0 to {top}, got {str(v)[:40]}")
    steps = data.get("steps", [])   # earlier releases: the greedy allocator's steps, kept, not read
    if not (isinstance(steps, list) and len(steps) <= 1 << 16 and all(isinstance(x, list) and len(x) <= 8
                                                                       for x in steps)):
        bad("'steps' must be a list of short lists")
    for k, t in (("model", str), ("complete", bool), ("press", dict)):
        if k in data and not isinstance(data[k], t):
            bad(f"'{k}' must be a {t.__name__}, got {type(data[k]).__name__}")
    guard = data.get("guard", {})
    if not (isinstance(guard, dict) and set(guard) <= _GUARD_NUMBERS | _GUARD_LISTS
            and all(_finite_number(guard[k]) for k in _GUARD_NUMBERS & set(guard))
            and all(isinstance(guard[k], list) and len(guard[k]) <= MAX_LAYERS and all(map(_finite_number, guard[k]))
                    for k in _GUARD_LISTS & set(guard))):
        bad("'guard' must be the retrieval guard's record: " + ", ".join(sorted(_GUARD_NUMBERS)) + " (numbers) and "
            + ", ".join(sorted(_GUARD_LISTS)) + " (lists of numbers)")
    probe = data.get("induction", {})
    if not (isinstance(probe, dict) and set(probe) <= _INDUCTION_NUMBERS | {"layers", "scores"}
            and all(_finite_number(probe[k]) for k in _INDUCTION_NUMBERS & set(probe))
            and isinstance(probe.get("layers", []), list) and len(probe.get("layers", [])) <= MAX_LAYERS
            and all(map(_finite_number, probe.get("layers", [])))
            and isinstance(probe.get("scores", []), list) and len(probe.get("scores", [])) <= MAX_LAYERS
            and all(isinstance(r, list) and len(r) <= 1 << 12 and all(map(_finite_number, r))
                    for r in probe.get("scores", []))):
        bad("'induction' must be the induction probe's record: " + ", ".join(sorted(_INDUCTION_NUMBERS)) +
            " (numbers), layers (a list of numbers) and scores (a list of lists of numbers a layer)")
    n_layers = data.get("n_layers", MAX_LAYERS)
    layers = data.get("layers", [])   # the layers the plan covers and their types (a hybrid's attention layers)
    if not (isinstance(layers, list) and len(layers) <= n_layers and all(
            isinstance(r, dict) and set(r) == {"layer", "type"} and is_int(r["layer"]) and 0 <= r["layer"] < n_layers
            and isinstance(r["type"], str) and 0 < len(r["type"]) <= 64 for r in layers)
            and len({r["layer"] for r in layers}) == len(layers)):
        bad("'layers' must list the plan's layers once each as {layer (below n_layers), type (a layer type name)}")
    rows = data.get("sensitivity", [])
    if not isinstance(rows, list) or len(rows) > 64 * 3 * max(1, n_layers):
        bad("'sensitivity' must be a list of figures (kind, layer, option, kld), a few per layer and kind")
    for r in rows:
        keep = isinstance(r, dict) and r.get("kind") == "keep"
        tag = _KEEP_TAG_RE if keep else TAG_RE
        if not (isinstance(r, dict) and {"kind", "layer", "kld"} <= set(r) <= {"kind", "layer", "option", "kld"}
                and r["kind"] in ("key", "value", "keep") and is_int(r["layer"]) and 0 <= r["layer"] < n_layers
                and _finite_number(r["kld"]) and r["kld"] >= 0
                and ("option" not in r or (isinstance(r["option"], str) and tag.fullmatch(r["option"])))
                and (not keep or "option" in r)):
            bad(f"sensitivity figure {str(r)[:80]} is not kind (key/value/keep), layer (below n_layers), option (a tag "
                "such as b3g128, or k0.5 for an eviction) and kld (a finite number >= 0)")
    return data
