"""KV-cache codec settings: one codec for keys, one for values, and the named schemes.

Schemes (``--scheme``):

- ``reference``: the reference design, bit-exact: symmetric INT4, groups along
  each token's values, FP16 scale (4.25 bits/value at groups of 64).
- ``symmetric`` / ``asymmetric``: that scheme on keys and values, groups along tokens' values.
- ``kivi``: keys asymmetric per channel (groups along tokens), values asymmetric per token.
- ``kvcx`` (default): keys asymmetric per channel (groups of 64 tokens) with the first token (the
  attention sink) kept exact; values symmetric per token after a Hadamard rotation of head_dim, their
  first token kept exact too. Chosen from bench/bench_quality.py; see README "Choosing the default".
- ``kvcx2w``: kvcx2's values; keys with a bit width per channel (2 bits on average, chosen per tensor from
  each channel's spread, weighed by the queries where a plan gives ``key_weights``), in groups of 32 tokens
  whose ranges are stored as two bytes (``--group-size`` sets the values' groups only): 2.5 bits/value
  nominal, README "Low bits".
- ``kvcx4w``: the default's values; keys with a width per channel (4 bits on average, groups of 64 tokens, the sink
  exact): fewer bits than ``kvcx`` and half its KLD on held-out text (docs/results/kvcx4w-quality.md).
- ``kvcx2v``: no calibration, 2.75 bits/value counted whole: keys with a width per channel (87/32 bits on average,
  groups of 64 tokens), values on QuIP#'s E8P lattice (:class:`~kvcx.codecs.lattice.E8PCodec`); sinks exact.
- ``kvcx3`` / ``kvcx2``: the low-bit presets: the kvcx layout at 3 bits, and at 2 bits with asymmetric
  values (symmetric 2-bit codes have only 3 useful levels). With a per-layer plan from ``kvcx calibrate`` (``layer_bits``:
  the layers the model is most sensitive to get more bits) they are the frontier of README "Low bits".
  Both carry the same *variants*, the codecs a plan may give a layer: keys at 2, 3, 4 bits in groups of
  64 tokens and at 3, 4 bits in groups of 128; values asymmetric at 2 bits, symmetric or asymmetric at 3 and 4.

Per-layer widths: ``KVConfig(..., layer_bits=((layer, key_sel, value_sel), ...))`` gives those layers other
codecs. A selection is a bit width (the base codec with only ``bits`` changed, or the ``variants`` entry
``bN`` where there is one) or the tag of a variant (``'b3g128'``: ``variants`` ``{"key.b3g128": codec}``).
The presets kvcx3/kvcx2 define the variants `kvcx calibrate` chooses from (:meth:`KVConfig.options`). A tensor's layer comes from its name (``layer_3_key``, ``past_key_values.3.0``,
``model.layers.3.k_cache``: the number after ``layer``/``layers``/``past_key_values``); tensors without one
get the base codecs. In a packed file each width is a codec of its own (``key.b4``, ``value.b2``), so any
format-2 reader decodes it. Keys with a width per channel (kvcx2w, kvcx4w, kvcx2v) take per-layer selections of
widths keys alone, the values' own codec in every layer: a calibrated plan's mean widths (``key.b1w``, ``key.b2hw``
= 2.5 bits, ... ``key.b4w``: :mod:`kvcx.quality.width_plans`) and the retrieval guard's (:meth:`KVConfig.guarded`:
``key.b8w`` in the guarded layers).

Kept layers: ``KVConfig(..., keep_layers=(0, 1))`` leaves those layers' tensors exact (a packed file stores them as
they are): the layers an engine keeps in the model's dtype, which :meth:`KVConfig.engine_layers` fills in for a model
(vLLM's TurboQuant schemes: a dense model's first and last two).

A tensor that a codec cannot take (channel grouping of a 1-D tensor, a rotation of a last dim that is
not a power of two) gets the ``fallback`` codec instead: the value codec's scheme, bits and group size,
grouped per token, without rotation or sinks. The packed file records which codec each tensor used.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from kvcx.codecs import engine as _engine  # noqa: F401  (registers the engine formats' codecs)
from kvcx.codecs import lattice as _lattice  # noqa: F401  (registers the E8P lattice codec)
from kvcx.codecs import turboquant as _turboquant
from kvcx.codecs.base import Codec, get_codec
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.intcodec import BITS, IntCodec
from kvcx.codecs.plan_record import MAX_LAYERS, TAG_RE
from kvcx.codecs.rope import MODEL, check_key_rope
from kvcx.codecs.widths import WidthCodec
from kvcx.errors import CodecError

DEFAULT_SCHEME = "kvcx"

# scheme -> (key settings, value settings); group size / bits / sinks / rotate may be overridden
_SCHEMES = {
    "reference": (dict(scheme="symmetric", axis="token"), dict(scheme="symmetric", axis="token")),
    "symmetric": (dict(scheme="symmetric", axis="token"), dict(scheme="symmetric", axis="token")),
    "asymmetric": (dict(scheme="asymmetric", axis="token"), dict(scheme="asymmetric", axis="token")),
    "kivi": (dict(scheme="asymmetric", axis="channel"), dict(scheme="asymmetric", axis="token")),
    # chosen from bench/bench_quality.py (README "Choosing the default"): 4.43 bits/value at groups of 64 on
    # 512-token contexts; keys and values both keep the sink token exact (values: KLD 0.00365 -> 0.00310)
    "kvcx": (dict(scheme="asymmetric", axis="channel", sinks=1),
             dict(scheme="symmetric", axis="token", rotate=True, sinks=1)),
    # the low-bit presets (README "Low bits"): measured best layouts at 3 and 2 bits; values keep the sink
    # token exact as in the default (it halves their KLD at 3 and 2 bits)
    "kvcx3": (dict(scheme="asymmetric", axis="channel", sinks=1, bits=3),
              dict(scheme="symmetric", axis="token", rotate=True, bits=3, sinks=1)),
    "kvcx2": (dict(scheme="asymmetric", axis="channel", sinks=1, bits=2),
              dict(scheme="asymmetric", axis="token", rotate=True, bits=2, sinks=1)),
}
# keys with per-channel widths (kvcx.codecs.widths.WidthCodec: 2 bits per code on average, groups of 32 tokens whose
# ranges are two bytes) and kvcx2's values: 2.5 bits/value nominal, the 2.6-bit frontier point (README "Low
# bits"); with a plan's key_weights (`kvcx calibrate --scheme kvcx2w`) the widths follow the queries
# kvcx2v (no calibration, 2.75 bits/value counted whole): keys' widths 87/32 bits on average in groups of 64 tokens,
# E8P values (kvcx.codecs.lattice), sinks exact; the groups and sinks chosen in docs/results/low-bits-study.md;
# kvcx4w: the default's values, keys' widths 4 bits on average in groups of 64 (docs/results/kvcx4w-quality.md)
_WIDTH_SCHEMES = {"kvcx2w": (dict(id="kvcx.widths", bits=2.0, group_size=32, sinks=1),
                             dict(id="kvcx.int", **_SCHEMES["kvcx2"][1])),
                  "kvcx4w": (dict(id="kvcx.widths", bits=4.0, group_size=64, sinks=1),
                             dict(id="kvcx.int", **_SCHEMES["kvcx"][1])),
                  "kvcx2v": (dict(id="kvcx.widths", bits=2.71875, group_size=64, sinks=1), dict(id="kvcx.e8p", sinks=1))}
# engine formats (kvcx.codecs.engine, kvcx.codecs.turboquant): the codecs the engines write their caches with (one for
# keys and values, or a pair)
_GGML_SCHEMES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
_ENGINE_SCHEMES = {**{t: dict(id="llama.cpp", type=t, rotate=False) for t in _GGML_SCHEMES},
                   **{f"{t}-rot": dict(id="llama.cpp", type=t, rotate=True) for t in _GGML_SCHEMES},
                   "fp8_e4m3": dict(id="vllm.fp8", format="e4m3", scale=1.0),
                   "fp8_e5m2": dict(id="vllm.fp8", format="e5m2", scale=1.0),
                   "fp8_e4m3-amax": dict(id="vllm.fp8", format="e4m3", scale="amax"),
                   "fp8_e5m2-amax": dict(id="vllm.fp8", format="e5m2", scale="amax"),
                   "mxfp4": dict(id="fp4", format="mxfp4"),
                   "nvfp4": dict(id="fp4", format="nvfp4", scale=1.0),
                   "nvfp4-amax": dict(id="fp4", format="nvfp4", scale="amax"),
                   # vLLM's TurboQuant presets (kvcx.codecs.turboquant): a key codec and a value codec
                   **_turboquant.PRESETS}
ENGINE_SCHEMES = tuple(_ENGINE_SCHEMES)
SCHEME_NAMES = tuple(_SCHEMES) + tuple(_WIDTH_SCHEMES) + ENGINE_SCHEMES
# the low-bit presets' options: the codecs a plan from `kvcx calibrate` may give a layer's keys or values,
# each named by a tag (bN = N bits; g128 = groups of 128; a = asymmetric), chosen from all-layer KLD screens
# (README "Low bits"): finer groups pay better than more bits in places, values at 3 bits pay asymmetric
_LADDER_SCHEMES = ("kvcx3", "kvcx2")
_LADDER = {
    "key": {"b2": dict(bits=2), "b3": dict(bits=3), "b3g128": dict(bits=3, group_size=128), "b4": dict(bits=4),
            "b4g128": dict(bits=4, group_size=128)},
    "value": {"b2": dict(bits=2, scheme="asymmetric"), "b3": dict(bits=3, scheme="symmetric"),
              "b3a": dict(bits=3, scheme="asymmetric"), "b4": dict(bits=4, scheme="symmetric"),
              "b4a": dict(bits=4, scheme="asymmetric")},
}

_KEY_WORDS = {"key", "keys", "k"}
_VALUE_WORDS = {"value", "values", "v"}
# transformers' legacy tuples: past_key_values.<layer>.<0 = key | 1 = value>
_LEGACY_RE = re.compile(r"(^|[._])past_key_values?[._](\d+)[._]([01])$", re.IGNORECASE)
_LAYER_RE = re.compile(r"(?:^|[^a-z])(?:layers?|past_key_values?|blocks?)[._]?(\d+)(?![0-9])", re.IGNORECASE)


def layer_of(name: str) -> Optional[int]:
    """The layer index in a tensor's name (``layer_3_key``, ``past_key_values.3.0``, ``layers.3.v_cache``), or None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def is_key_tensor(name: str) -> bool:
    """Whether a tensor gets the key codec, from its name's words (split on anything not a letter).

    The last word that names a kind decides: ``layer_3_key``, ``k_cache.0``, ``model.k_proj`` are keys;
    ``layer_3_value``, ``monkey_value``, ``v_cache`` are values; ``past_key_values.0.0`` / ``.0.1`` (the
    legacy tuple layout) is a key / a value by its last index. Names without such a word get the value codec.
    """
    return tensor_kind(name) == "key"


def tensor_kind(name: str) -> Optional[str]:
    """``"key"`` or ``"value"`` as the tensor's name says (see :func:`is_key_tensor`), None when it names neither
    (such a tensor gets the value codec)."""
    m = _LEGACY_RE.search(name)
    if m:
        return "key" if m.group(3) == "0" else "value"
    words = [w for w in re.split(r"[^a-z]+", name.lower()) if w]
    for w in reversed(words):
        if w in _KEY_WORDS or (w.startswith("k") and w[1:] in ("proj", "cache")):
            return "key"
        if w in _VALUE_WORDS or (w.startswith("v") and w[1:] in ("proj", "cache")):
            return "value"
    return None


def _check_layer_bits(layer_bits) -> tuple:
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


def _check_variants(variants) -> tuple:
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
        widths = m.group(1) == "key" and name.endswith(_WIDTHS_SUFFIX)   # keys of a width per channel
        bits = widths_bits(m.group(2)) if widths else int(m.group(3))
        if bits is None or not isinstance(codec, WidthCodec if widths else IntCodec) or codec.bits != bits:
            raise CodecError(f"variants: {name!r} must be {'a widths' if widths else 'an integer'} codec of "
                             f"{bits if bits is not None else m.group(3)} bits (widths tags: b2w = 2 bits, b2hw = "
                             f"2.5), got {getattr(codec, 'bits', codec)!r}")
        if name in out:
            raise CodecError(f"variants lists {name!r} twice; give each once")
        out[name] = codec
    return tuple(sorted(out.items()))


def _check_key_weights(key_weights) -> tuple:
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


GUARD_BITS = 8   # the key width the retrieval guards give the layers they guard
DEFAULT_GUARD_GROUP = 64   # the guard's key groups (tokens) where the scheme's keys are grouped per token
_WIDTHS_SUFFIX = "w"   # a key variant's tag ending so ('b8w'): a widths codec (WidthCodec), every channel its bits
_WIDTHS_TAG = re.compile(r"b([1-8])(h?)w")   # b2w: 2 bits per code on average; b2hw: 2.5


def widths_tag(bits: float) -> str:
    """The variant tag of widths keys of ``bits`` per code on average, a whole or half number from 1 to 8: 2 ->
    'b2w', 2.5 -> 'b2hw' (the guard's 8-bit keys: 'b8w')."""
    if not (1 <= bits <= 8 and (2 * bits) % 1 == 0) or (bits > 4 and bits != 8):
        raise CodecError(f"widths keys take a variant tag at 1, 1.5, ... 4 or 8 bits per code, not {bits!r}")
    return f"b{int(bits)}{'h' if bits % 1 else ''}{_WIDTHS_SUFFIX}"


def widths_bits(tag: str) -> Optional[float]:
    """The mean bits per code a widths variant's tag names ('b2hw' -> 2.5), or None for another tag."""
    m = _WIDTHS_TAG.fullmatch(tag)
    return None if m is None else int(m.group(1)) + (0.5 if m.group(2) else 0.0)


@dataclass(frozen=True)
class KVConfig:
    key: Codec
    value: Codec
    scheme: str = "custom"
    layer_bits: tuple = ()   # ((layer, key_bits, value_bits), ...): per-layer widths overriding the codecs' bits
    variants: tuple = ()     # (("key.b3g128", codec), ...): named codecs a layer may select (the presets' options)
    key_weights: tuple = ()  # ((layer, ((w, ...), ...)), ...): per KV head and channel, how much the queries
    #                          weigh a key channel's error (``kvcx calibrate --key-weights``); WidthCodec keys only
    keep_layers: tuple = ()  # layers whose keys and values stay exact (an engine's layers in the model's dtype:
    #                          vLLM's TurboQuant keeps a dense model's first and last two, see engine_layers)
    key_rope: object = None  # keys coded before RoPE (kvcx.codecs.rope): None (as the model hands them), "model"
    #                          (the model's own frequencies, filled in where it loads) or a KeyRope

    def __post_init__(self):
        object.__setattr__(self, "layer_bits", _check_layer_bits(self.layer_bits))
        kept = self.keep_layers
        if not (isinstance(kept, (tuple, list)) and all(is_int(L) and 0 <= L < MAX_LAYERS for L in kept)):
            raise CodecError(f"keep_layers must be a list of layer indices in [0, {MAX_LAYERS}), got {kept!r}")
        object.__setattr__(self, "keep_layers", tuple(sorted({int(L) for L in kept})))
        object.__setattr__(self, "key_weights", _check_key_weights(self.key_weights))
        object.__setattr__(self, "key_rope", check_key_rope(self.key_rope))
        if self.key_weights and not self.key.takes_weights:
            raise CodecError("key_weights choose per-channel widths; they need a widths key codec "
                             "(--scheme kvcx2w), not " + repr(self.key))
        if self.value.takes_weights:
            raise CodecError("per-channel widths are for keys; give values an IntCodec")
        object.__setattr__(self, "variants", _check_variants(self.variants))
        if not isinstance(self.key, IntCodec) and (self.layer_bits or self.variants) and not self._widths_only():
            raise CodecError("a widths key codec (kvcx2w, kvcx2v) takes per-layer selections of widths keys alone "
                             "(variants key.b2w, key.b2hw, ...: a calibrated plan's mean widths, the retrieval guard's "
                             "8-bit keys), its values the scheme's codec in every layer")
        names = {n for n, _ in self.variants}
        for L, kb, vb in self.layer_bits:
            for kind, sel in (("key", kb), ("value", vb)):
                if isinstance(sel, str) and f"{kind}.{sel}" not in names:
                    raise CodecError(f"layer_bits: layer {L} selects {kind} variant {sel!r}, which the config does not "
                                     f"define; defined: {', '.join(sorted(names)) or 'none'}")

    def _widths_only(self) -> bool:
        """Whether the per-layer selections are widths keys alone (a calibrated plan's mean widths,
        :mod:`kvcx.quality.width_plans`; the guard's 8-bit keys, :meth:`guarded`): key variants of a width per
        channel, the values' own codec in every layer (what a config with widths keys may select)."""
        own = getattr(self.value, "bits", None)
        return all(n.startswith("key.") and n.endswith(_WIDTHS_SUFFIX) for n, _ in self.variants) and \
            all(isinstance(kb, str) and kb.endswith(_WIDTHS_SUFFIX) and vb == own for _, kb, vb in self.layer_bits)

    def codec_at(self, kind: str, sel) -> IntCodec:
        """The codec keys (``kind='key'``) or values get for a selection: a variant's tag (``'b3g128'``), or a
        bit width: the ``variants`` entry ``bN`` where there is one, the base codec at its own width, else the
        base codec with only ``bits`` changed."""
        base = self.key if kind == "key" else self.value
        name = f"{kind}.{tag_of(sel)}"
        for n, codec in self.variants:
            if n == name:
                return codec.with_threads(base.n_threads) if codec.n_threads != base.n_threads else codec
        if isinstance(sel, str):
            raise CodecError(f"no {kind} variant {sel!r} in this config")
        return base if sel == base.bits else _with_bits(base, sel)

    def options(self, kind: str, max_bits: int = 4) -> list:
        """The selections a plan may give ``kind``: the variants' tags where the config has some for it,
        else the widths from the base codec's up to ``max_bits``."""
        tags = [n.split(".", 1)[1] for n, _ in self.variants if n.startswith(kind + ".")]
        if tags:
            return tags
        base = (self.key if kind == "key" else self.value).bits
        return [f"b{b}" for b in BITS if base <= b <= max(base, max_bits)]

    def weights_for(self, name: str):
        """The key weights (heads x head_dim float64 array) for a tensor, or None."""
        if not self.key_weights or not is_key_tensor(name):
            return None
        import numpy as np

        layer = layer_of(name)
        for L, w in self.key_weights:
            if L == layer:
                return np.asarray(w, dtype=np.float64)
        return None

    def base(self) -> "KVConfig":
        """This config without its per-layer selections (its variants kept)."""
        return KVConfig(key=self.key, value=self.value, scheme=self.scheme, variants=self.variants,
                        keep_layers=self.keep_layers, key_rope=self.key_rope)

    def engine_layers(self, n_layers: int, hybrid: bool) -> "KVConfig":
        """This config as its engine runs it on a model of ``n_layers`` layers (``hybrid``: with linear-attention
        or recurrent layers): vLLM's TurboQuant schemes keep the first and last two layers of a dense model exact
        (``--kv-cache-dtype-skip-layers``, set by ``get_boundary_skip_layers``; none on hybrids). Other schemes, or
        a config whose kept layers are already set, are returned as they are."""
        if self.scheme not in _turboquant.PRESETS or self.keep_layers:
            return self
        kept = () if hybrid else _turboquant.boundary_layers(n_layers)
        return KVConfig(key=self.key, value=self.value, scheme=self.scheme, keep_layers=kept,
                        key_rope=self.key_rope) if kept else self

    @classmethod
    def from_scheme(cls, scheme: str = DEFAULT_SCHEME, group_size: Optional[int] = None, bits: Optional[int] = None,
                    sinks: Optional[int] = None, rotate: Optional[bool] = None,
                    n_threads: Optional[int] = None) -> "KVConfig":
        if scheme in _ENGINE_SCHEMES:
            given = [f"{k}={v!r}" for k, v in (("group_size", group_size), ("bits", bits), ("sinks", sinks),
                                                 ("rotate", rotate)) if v is not None]
            if given:
                base = scheme[:-4] if scheme.endswith("-rot") else scheme
                hint = f" (its rotation is the scheme {base + '-rot'!r})" if f"{base}-rot" in _ENGINE_SCHEMES else ""
                raise CodecError(f"scheme={scheme!r} is an engine's format, emulated as the engine defines it; leave "
                                 f"out {', '.join(given)}{hint}")
            spec = _ENGINE_SCHEMES[scheme]
            if isinstance(spec, tuple):    # keys and values in formats of their own (TurboQuant)
                return cls(key=get_codec(spec[0], n_threads), value=get_codec(spec[1], n_threads), scheme=scheme)
            codec = get_codec(spec, n_threads)
            key = get_codec({**spec, "rotate": "key"}, n_threads) if scheme.endswith("-rot") \
                else codec    # llama.cpp rotates K over the largest power of two dividing the head dim, V over 64
            return cls(key=key, value=codec, scheme=scheme)
        if scheme in _WIDTH_SCHEMES:
            if bits is not None or rotate is not None:
                raise CodecError(f"scheme={scheme!r} sets its own bits and rotation; leave them out, or use "
                                 "scheme='kvcx2' (or scheme='kvcx') to change them")
            kw, vkw = (dict(d) for d in _WIDTH_SCHEMES[scheme])
            for d in (kw, vkw):
                if sinks is not None:
                    d["sinks"] = sinks
            value = get_codec(vkw, n_threads)
            if group_size is not None:   # the values' groups (the keys keep theirs)
                if "group_size" not in value.settings:
                    raise CodecError(f"scheme={scheme!r}: its values ({value.describe()}) have no groups to size; "
                                     "leave out group_size")
                value = get_codec({**vkw, "group_size": group_size}, n_threads)
            return cls(key=get_codec(kw, n_threads), value=value, scheme=scheme)
        if scheme not in _SCHEMES and ("+" in str(scheme) or ":" in str(scheme)):
            raise CodecError(f"scheme {scheme!r} composes token eviction (a press) with a codec: presses run in "
                             "`kvcx validate`, `kvcx calibrate` and KvcxCache(scheme=...); a file keeps every token, so "
                             f"here give the codec alone (one of {', '.join(SCHEME_NAMES)})")
        if scheme not in _SCHEMES:
            raise CodecError(f"unknown scheme {scheme!r}; use one of {', '.join(SCHEME_NAMES)}")
        if scheme == "reference" and (bits not in (None, 4) or sinks or rotate):
            raise CodecError("scheme 'reference' is the reference design (4 bits, no sinks, no rotation); "
                             "use --scheme symmetric to change those")
        codecs = []
        for base in _SCHEMES[scheme]:
            kw = dict(base)
            kw["group_size"] = group_size if group_size is not None else 64
            if bits is not None:
                kw["bits"] = bits
            if sinks is not None:
                kw["sinks"] = sinks
            if rotate is not None:
                kw["rotate"] = rotate
            codecs.append(IntCodec(n_threads=n_threads, **kw))
        variants = []
        if scheme in _LADDER_SCHEMES:
            for kind, c in (("key", codecs[0]), ("value", codecs[1])):
                for tag, diff in _LADDER[kind].items():
                    variants.append((f"{kind}.{tag}", IntCodec.from_config(
                        {**c.get_config(), "group_size": c.group_size, **diff, "n_threads": n_threads})))
        return cls(key=codecs[0], value=codecs[1], scheme=scheme, variants=variants)

    @classmethod
    def from_config(cls, config: dict, n_threads: Optional[int] = None) -> "KVConfig":
        """The inverse of :meth:`get_config` (a plan file written by ``kvcx calibrate`` is one)."""
        if not isinstance(config, dict) or not {"key", "value"} <= set(config):
            raise CodecError("a kvcx config must be an object with 'key' and 'value' codecs "
                             "(and optionally 'scheme' and 'layer_bits'), as `kvcx calibrate` writes")
        unknown = set(config) - {"scheme", "key", "value", "layer_bits", "variants", "key_weights", "keep_layers",
                                 "key_rope"}
        if unknown:
            raise CodecError(f"unknown kvcx config fields {sorted(unknown)}; known: scheme, key, value, layer_bits, "
                             "variants, key_weights, keep_layers, key_rope")
        for k in ("key", "value"):
            if not isinstance(config[k], dict):
                raise CodecError(f"a kvcx config's {k} codec must be an object, got {config[k]!r}")
        codecs = [get_codec(config[k], n_threads) for k in ("key", "value")]
        scheme = config.get("scheme", "custom")
        if not isinstance(scheme, str):
            raise CodecError(f"a kvcx config's scheme must be a string, got {scheme!r}")
        variants = config.get("variants", {})
        if not isinstance(variants, dict):
            raise CodecError(f"a kvcx config's variants must be an object of 'key.TAG' / 'value.TAG' codecs, "
                             f"got {variants!r}")
        variants = {k: get_codec(v, n_threads) if isinstance(v, dict) else v for k, v in variants.items()}
        return cls(key=codecs[0], value=codecs[1], scheme=scheme, layer_bits=config.get("layer_bits", ()),
                   variants=variants, key_weights=config.get("key_weights", ()),
                   keep_layers=config.get("keep_layers", ()), key_rope=config.get("key_rope"))

    def guarded(self, layers, bits: int = GUARD_BITS) -> "KVConfig":
        """This config (a scheme's, no per-layer widths; keys of integer codes or of a width per channel) with
        ``bits``-bit keys in ``layers``, their values as the config gives them: the retrieval guards' plans
        (kvcx.quality.guard, kvcx.cache.induction). Key weights and kept layers stay as they are.

        The guarded keys are a widths codec with every channel at ``bits`` (the variant ``key.b8w``:
        :class:`~kvcx.codecs.widths.WidthCodec`, groups of the keys' tokens, the keys' sinks): the same per-channel
        endpoint codes as 8-bit integer keys grouped per channel, which the fused CPU kernel reads (8-bit integer
        codes it does not: those layers would decode their whole context every step), and ranges of two bytes
        instead of four (6.25 bits/value a layer with the default's values, against 6.375)."""
        if self.layer_bits:
            raise CodecError("the guard starts from a scheme's config, without per-layer widths; pass a scheme, not a "
                             "plan")
        if not isinstance(self.key, (IntCodec, WidthCodec)):
            raise CodecError(f"the guard gives 8-bit keys on top of kvcx's own keys (integer codes or a width per "
                             f"channel), not {self.key.describe()}: pass one of kvcx's schemes (kvcx, kvcx3, kvcx2v, "
                             "...), not an engine's format")
        tag = widths_tag(bits)
        per_channel = isinstance(self.key, WidthCodec) or getattr(self.key, "axis", None) == "channel"
        group = self.key.group_size if per_channel else DEFAULT_GUARD_GROUP
        codec = WidthCodec(bits=bits, group_size=group, sinks=self.key.sinks, n_threads=self.key.n_threads)
        variants = tuple(v for v in self.variants if v[0] != f"key.{tag}") + ((f"key.{tag}", codec),)
        return dataclasses.replace(self, variants=variants,
                                   layer_bits=tuple((int(L), tag, self.value.bits) for L in sorted(layers)))

    def with_threads(self, n_threads: Optional[int]) -> "KVConfig":
        return dataclasses.replace(self, key=self.key.with_threads(n_threads), value=self.value.with_threads(n_threads),
                                   variants=tuple((n, c.with_threads(n_threads)) for n, c in self.variants))

    def with_backend(self, backend: Optional[str]) -> "KVConfig":
        """This config with its codecs working torch tensors on ``backend`` (see kvcx.codecs.backends)."""
        return dataclasses.replace(self, key=self.key.with_backend(backend), value=self.value.with_backend(backend),
                                   variants=tuple((n, c.with_backend(backend)) for n, c in self.variants))

    def for_layer(self, layer: Optional[int]) -> "KVConfig":
        """This config with the key and value bits of ``layer`` (no per-layer widths left)."""
        for L, kb, vb in self.layer_bits:
            if L == layer:
                return KVConfig(key=self.codec_at("key", kb), value=self.codec_at("value", vb), scheme=self.scheme,
                                key_rope=self.key_rope)
        if not self.layer_bits:
            return self
        return KVConfig(key=self.key, value=self.value, scheme=self.scheme, key_rope=self.key_rope)

    def bits_per_value(self, layers) -> float:
        """Nominal bits per value over ``layers`` (a count: layers 0..n-1; or the layer indices, a hybrid model's
        attention layers) of equal size (codes, scales, zero points)."""
        layers = range(layers) if isinstance(layers, int) else list(layers)
        total = 0.0
        for L in layers:
            c = self.for_layer(L)
            total += 32.0 if L in self.keep_layers else c.key.bits_per_value() + c.value.bits_per_value()
        return total / (2 * len(layers))

    @property
    def fallback(self) -> Codec:
        """The codec of tensors the key or value codec cannot take: the value codec's fallback (for integer
        codecs its scheme, bits and group size, grouped per token, without rotation or sinks)."""
        return self.value.fallback()

    def _name(self, kind: str, sel) -> Tuple[str, IntCodec]:
        codec = self.codec_at(kind, sel)
        return (kind if codec == (self.key if kind == "key" else self.value) else f"{kind}.{tag_of(sel)}"), codec

    def codecs(self) -> dict:
        """Every codec a tensor may get, by the name a packed file records (``key.b4``, ``value.b3a``: a
        layer's selection other than the base codec)."""
        out = {"key": self.key, "value": self.value, "fallback": self.fallback}
        for _, kb, vb in self.layer_bits:
            for kind, sel in (("key", kb), ("value", vb)):
                name, codec = self._name(kind, sel)
                out[name] = codec
        return out

    def codec_for(self, name: str, shape=None) -> Tuple[str, Optional[Codec]]:
        """(kind, codec) for a tensor: 'key' or 'value' by name ('key.b4' where its layer selects another
        codec), 'fallback' where that codec cannot take the shape, ('kept', None) in a layer kept exact."""
        if self.keep_layers and layer_of(name) in self.keep_layers:
            return "kept", None
        kind = "key" if is_key_tensor(name) else "value"
        base = self.key if kind == "key" else self.value
        label, codec = kind, base
        layer = layer_of(name) if self.layer_bits else None
        for L, kb, vb in self.layer_bits:
            if L == layer:
                label, codec = self._name(kind, kb if kind == "key" else vb)
        if shape is not None and not codec.supports(shape):
            return "fallback", self.fallback
        return label, codec

    def get_config(self) -> dict:
        cfg = {"scheme": self.scheme, "key": self.key.get_config(), "value": self.value.get_config()}
        if self.layer_bits:
            cfg["layer_bits"] = [list(r) for r in self.layer_bits]
        if self.variants:
            cfg["variants"] = {n: c.get_config() for n, c in self.variants}
        if self.key_weights:
            cfg["key_weights"] = {str(L): [list(r) for r in w] for L, w in self.key_weights}
        if self.keep_layers:
            cfg["keep_layers"] = list(self.keep_layers)
        if self.key_rope is not None:
            cfg["key_rope"] = self.key_rope if self.key_rope == MODEL else self.key_rope.get_config()
        return cfg

    def describe(self) -> str:
        def one(c) -> str:
            return c.describe() + (" (query-weighted)" if c.takes_weights and self.key_weights else "")
        text = f"{self.scheme}: K {one(self.key)}, V {one(self.value)}"
        if self.layer_bits:
            text += "; per layer K/V bits " + ", ".join(f"{L}:{kb}/{vb}" for L, kb, vb in self.layer_bits)
            used = {n: c for n, c in self.codecs().items() if "." in n}
            if used:
                text += " (" + ", ".join(f"{n} = {one(c)}" for n, c in sorted(used.items())) + ")"
        if self.keep_layers:
            text += "; layers " + ", ".join(map(str, self.keep_layers)) + " kept exact"
        if self.key_rope is not None:
            text += "; keys coded before RoPE"
        return text

    def with_key_rope(self, key_rope) -> "KVConfig":
        """This config with its keys coded in ``key_rope``'s frame (None: as the model hands them)."""
        return dataclasses.replace(self, key_rope=key_rope)


def _with_bits(codec: IntCodec, bits: int) -> IntCodec:
    if bits == codec.bits:
        return codec
    return IntCodec.from_config({**codec.get_config(), "bits": bits, "n_threads": codec.n_threads})
