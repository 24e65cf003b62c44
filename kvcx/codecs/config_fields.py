"""The fields of a :class:`~kvcx.codecs.KVConfig` checked as it is made (per-layer selections, variants, key
weights, lists of layers), and the tags that name a layer's selection (``b3``, ``b3g128``, the widths keys'
``b2w``/``b2hw``). Every error is a CodecError that names the field and says how to fix it."""
from __future__ import annotations

import re
from typing import Optional

from kvcx.codecs.base import get_codec
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.intcodec import BITS, IntCodec
from kvcx.codecs.plan_record import MAX_LAYERS, TAG_RE
from kvcx.codecs.widths import WidthCodec
from kvcx.errors import CodecError

WIDTHS_SUFFIX = "w"   # a key variant's tag ending so ('b8w'): a widths codec (WidthCodec), every channel its bits
_WIDTHS_TAG = re.compile(r"b([1-8])(h?)w")   # b2w: 2 bits per code on average; b2hw: 2.5


def check_layers(layers, field: str, what: str) -> tuple:
    """A list of layer indices (``keep_layers``, ``latent_layers``) as a sorted tuple without repeats; CodecError
    naming ``field`` (``what``: the layers it means) otherwise."""
    if not (isinstance(layers, (tuple, list)) and all(is_int(L) and 0 <= L < MAX_LAYERS for L in layers)):
        raise CodecError(f"{field} must be a list of layer indices in [0, {MAX_LAYERS}) ({what}), got {layers!r}")
    return tuple(sorted({int(L) for L in layers}))


def check_layer_bits(layer_bits) -> tuple:
    """((layer, key_bits, value_bits), ...) sorted by layer, each checked; the error says how to fix it."""
    if isinstance(layer_bits, dict):
        layer_bits = [(k, *v) if isinstance(v, (list, tuple)) else (k, v) for k, v in layer_bits.items()]
    try:
        rows = [tuple(r) for r in layer_bits]
    except TypeError:
        raise CodecError(f"layer_bits must be a list of [layer, key_bits, value_bits], got {layer_bits!r}") from None
    out, seen = [], set()
    for r in rows:
        if len(r) != 3:
            raise CodecError(f"layer_bits entry {list(r)} must be [layer, key_bits, value_bits]")
        layer, kb, vb = (int(x) if is_int(x) else x for x in r)
        if not is_int(layer) or not 0 <= layer < MAX_LAYERS:
            raise CodecError(f"layer_bits: layer {layer!r} must be an integer in [0, {MAX_LAYERS})")
        for what, b in (("key", kb), ("value", vb)):
            if isinstance(b, str) and TAG_RE.fullmatch(b):
                continue
            if not is_int(b) or b not in BITS:
                raise CodecError(f"layer_bits: layer {layer} {what} bits {b!r} is not one of {', '.join(map(str, BITS))} "
                                 "or the tag of one of the config's variants (e.g. 'b3g128')")
        if layer in seen:
            raise CodecError(f"layer_bits lists layer {layer} twice; give each layer once")
        seen.add(layer)
        out.append((layer, kb, vb))
    return tuple(sorted(out))


def check_variants(variants) -> tuple:
    """(("key.b3g128" | "value.b3a" ..., IntCodec), ...) sorted by name; each codec's bits match its tag."""
    if isinstance(variants, dict):
        variants = list(variants.items())
    out = {}
    for row in variants:
        try:
            name, codec = row
        except (TypeError, ValueError):
            raise CodecError(f"variants must map 'key.TAG' / 'value.TAG' to a codec, got {row!r}") from None
        m = re.fullmatch(r"(key|value)\.(" + TAG_RE.pattern + ")", name) if isinstance(name, str) else None
        if m is None:
            raise CodecError(f"variants: {name!r} is not a variant name; use 'key.TAG' or 'value.TAG' with TAG = "
                             "b<bits> and an optional suffix (e.g. 'value.b3', 'key.b3g128')")
        if isinstance(codec, dict):
            codec = get_codec(codec)
        widths = m.group(1) == "key" and name.endswith(WIDTHS_SUFFIX)   # keys of a width per channel
        bits = widths_bits(m.group(2)) if widths else int(m.group(3))
        if bits is None or not isinstance(codec, WidthCodec if widths else IntCodec) or codec.bits != bits:
            raise CodecError(f"variants: {name!r} must be {'a widths' if widths else 'an integer'} codec of "
                             f"{bits if bits is not None else m.group(3)} bits (widths tags: b2w = 2 bits, b2hw = "
                             f"2.5), got {getattr(codec, 'bits', codec)!r}")
        if name in out:
            raise CodecError(f"variants lists {name!r} twice; give each once")
        out[name] = codec
    return tuple(sorted(out.items()))


def check_key_weights(key_weights) -> tuple:
    """((layer, ((w, ...), ...)), ...) sorted by layer: finite non-negative floats, heads x channels per layer."""
    import math

    if not isinstance(key_weights, (dict, list, tuple)):
        raise CodecError(f"key_weights must map layers to [[weight per channel] per KV head], got "
                         f"{type(key_weights).__name__}")
    if isinstance(key_weights, dict):
        items = []
        for k, v in key_weights.items():
            if not (isinstance(k, str) and k.isdigit()) and not is_int(k):
                raise CodecError(f"key_weights: {k!r} is not a layer number")
            items.append((int(k), v))
    else:
        items = list(key_weights)
    out, seen = [], set()
    for row in items:
        try:
            layer, w = row
            w = tuple(tuple(float(x) for x in head) for head in w)
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) for head in row[1] for x in head):
                raise TypeError
        except (TypeError, ValueError, OverflowError):
            raise CodecError(f"key_weights: each entry must be layer -> [[weight per channel] per KV head], got "
                             f"{str(row)[:60]}") from None
        if not is_int(layer) or not 0 <= int(layer) < MAX_LAYERS or int(layer) in seen:
            raise CodecError(f"key_weights: layer {layer!r} must be an integer in [0, {MAX_LAYERS}), given once")
        if not w or len({len(h) for h in w}) != 1 or not w[0] \
                or not all(math.isfinite(x) and x >= 0 for h in w for x in h):
            raise CodecError(f"key_weights: layer {layer} must list, per KV head, the same number of finite "
                             "non-negative weights (one per channel)")
        seen.add(int(layer))
        out.append((int(layer), w))
    return tuple(sorted(out))


def tag_of(sel) -> str:
    """A layer's selection as a tag: 3 -> 'b3', 'b3g128' stays."""
    return sel if isinstance(sel, str) else f"b{sel}"


def widths_tag(bits: float) -> str:
    """The variant tag of widths keys of ``bits`` per code on average, a whole or half number from 1 to 8: 2 ->
    'b2w', 2.5 -> 'b2hw' (the guard's 8-bit keys: 'b8w')."""
    if not (1 <= bits <= 8 and (2 * bits) % 1 == 0) or (bits > 4 and bits != 8):
        raise CodecError(f"widths keys take a variant tag at 1, 1.5, ... 4 or 8 bits per code, not {bits!r}")
    return f"b{int(bits)}{'h' if bits % 1 else ''}{WIDTHS_SUFFIX}"


def widths_bits(tag: str) -> Optional[float]:
    """The mean bits per code a widths variant's tag names ('b2hw' -> 2.5), or None for another tag."""
    m = _WIDTHS_TAG.fullmatch(tag)
    return None if m is None else int(m.group(1)) + (0.5 if m.group(2) else 0.0)
