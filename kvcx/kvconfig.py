"""KV-cache codec settings: one codec for keys, one for values, and the named schemes.

Schemes (``--scheme``):

- ``reference``: the reference design, bit-exact: symmetric INT4, groups along
  each token's values, FP16 scale (4.25 bits/value at groups of 64).
- ``symmetric`` / ``asymmetric``: that scheme on keys and values, groups along tokens' values.
- ``kivi``: keys asymmetric per channel (groups along tokens), values asymmetric per token.
- ``kvcx`` (default): keys asymmetric per channel (groups of 64 tokens) with the first token (the
  attention sink) kept exact; values symmetric per token after a Hadamard rotation of head_dim.
  Chosen from bench/bench_quality.py; see README "Choosing the default".
- ``kvcx3`` / ``kvcx2``: the low-bit presets: the kvcx layout at 3 bits, and at 2 bits with asymmetric
  values (symmetric 2-bit codes have only 3 useful levels). With a per-layer plan from ``kvcx calibrate`` (``layer_bits``:
  the layers the model is most sensitive to get more bits) they are the frontier of README "Low bits".

Per-layer widths: ``KVConfig(..., layer_bits=((layer, key_bits, value_bits), ...))`` overrides the codecs'
bits for those layers. A tensor's layer comes from its name (``layer_3_key``, ``past_key_values.3.0``,
``model.layers.3.k_cache``: the number after ``layer``/``layers``/``past_key_values``); tensors without one
get the base codecs. In a packed file each width is a codec of its own (``key.b4``, ``value.b2``), so any
format-2 reader decodes it.

A tensor that a codec cannot take (channel grouping of a 1-D tensor, a rotation of a last dim that is
not a power of two) gets the ``fallback`` codec instead: the value codec's scheme, bits and group size,
grouped per token, without rotation or sinks. The packed file records which codec each tensor used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

from kvcx.codec import IntCodec
from kvcx.errors import CodecError

DEFAULT_SCHEME = "kvcx"

# scheme -> (key settings, value settings); group size / bits / sinks / rotate may be overridden
_SCHEMES = {
    "reference": (dict(scheme="symmetric", axis="token"), dict(scheme="symmetric", axis="token")),
    "symmetric": (dict(scheme="symmetric", axis="token"), dict(scheme="symmetric", axis="token")),
    "asymmetric": (dict(scheme="asymmetric", axis="token"), dict(scheme="asymmetric", axis="token")),
    "kivi": (dict(scheme="asymmetric", axis="channel"), dict(scheme="asymmetric", axis="token")),
    # chosen from bench/bench_quality.py (README "Choosing the default"): 4.40 bits/value at groups of 64
    "kvcx": (dict(scheme="asymmetric", axis="channel", sinks=1), dict(scheme="symmetric", axis="token", rotate=True)),
    # the low-bit presets (README "Low bits"): measured best layouts at 3 and 2 bits
    "kvcx3": (dict(scheme="asymmetric", axis="channel", sinks=1, bits=3),
              dict(scheme="symmetric", axis="token", rotate=True, bits=3)),
    "kvcx2": (dict(scheme="asymmetric", axis="channel", sinks=1, bits=2),
              dict(scheme="asymmetric", axis="token", rotate=True, bits=2)),
}
SCHEME_NAMES = tuple(_SCHEMES)

_KEY_WORDS = {"key", "keys", "k"}
_VALUE_WORDS = {"value", "values", "v"}
# transformers' legacy tuples: past_key_values.<layer>.<0 = key | 1 = value>
_LEGACY_RE = re.compile(r"(^|[._])past_key_values?[._](\d+)[._]([01])$", re.IGNORECASE)
_LAYER_RE = re.compile(r"(?:^|[^a-z])(?:layers?|past_key_values?|blocks?)[._]?(\d+)(?![0-9])", re.IGNORECASE)
MAX_LAYERS = 1 << 16


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
    m = _LEGACY_RE.search(name)
    if m:
        return m.group(3) == "0"
    words = [w for w in re.split(r"[^a-z]+", name.lower()) if w]
    for w in reversed(words):
        if w in _KEY_WORDS or (w.startswith("k") and w[1:] in ("proj", "cache")):
            return True
        if w in _VALUE_WORDS or (w.startswith("v") and w[1:] in ("proj", "cache")):
            return False
    return False


def _check_layer_bits(layer_bits) -> tuple:
    """((layer, key_bits, value_bits), ...) sorted by layer, each checked; the error says how to fix it."""
    from kvcx.codec import BITS
    from kvcx.dtypes import is_int

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
            if not is_int(b) or b not in BITS:
                raise CodecError(f"layer_bits: layer {layer} {what} bits {b!r} is not one of {', '.join(map(str, BITS))}")
        if layer in seen:
            raise CodecError(f"layer_bits lists layer {layer} twice; give each layer once")
        seen.add(layer)
        out.append((layer, kb, vb))
    return tuple(sorted(out))


@dataclass(frozen=True)
class KVConfig:
    key: IntCodec
    value: IntCodec
    scheme: str = "custom"
    layer_bits: tuple = ()   # ((layer, key_bits, value_bits), ...): per-layer widths overriding the codecs' bits

    def __post_init__(self):
        object.__setattr__(self, "layer_bits", _check_layer_bits(self.layer_bits))

    @classmethod
    def from_scheme(cls, scheme: str = DEFAULT_SCHEME, group_size: Optional[int] = None, bits: Optional[int] = None,
                    sinks: Optional[int] = None, rotate: Optional[bool] = None,
                    n_threads: Optional[int] = None) -> "KVConfig":
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
        return cls(key=codecs[0], value=codecs[1], scheme=scheme)

    @classmethod
    def from_config(cls, config: dict, n_threads: Optional[int] = None) -> "KVConfig":
        """The inverse of :meth:`get_config` (a plan file written by ``kvcx calibrate`` is one)."""
        if not isinstance(config, dict) or not {"key", "value"} <= set(config):
            raise CodecError("a kvcx config must be an object with 'key' and 'value' codecs "
                             "(and optionally 'scheme' and 'layer_bits'), as `kvcx calibrate` writes")
        unknown = set(config) - {"scheme", "key", "value", "layer_bits"}
        if unknown:
            raise CodecError(f"unknown kvcx config fields {sorted(unknown)}; known: scheme, key, value, layer_bits")
        codecs = [IntCodec.from_config({**config[k], "n_threads": n_threads}) for k in ("key", "value")]
        scheme = config.get("scheme", "custom")
        if not isinstance(scheme, str):
            raise CodecError(f"a kvcx config's scheme must be a string, got {scheme!r}")
        return cls(key=codecs[0], value=codecs[1], scheme=scheme, layer_bits=config.get("layer_bits", ()))

    def with_threads(self, n_threads: Optional[int]) -> "KVConfig":
        return KVConfig(key=self.key.with_threads(n_threads), value=self.value.with_threads(n_threads),
                        scheme=self.scheme, layer_bits=self.layer_bits)

    def for_layer(self, layer: Optional[int]) -> "KVConfig":
        """This config with the key and value bits of ``layer`` (no per-layer widths left)."""
        for L, kb, vb in self.layer_bits:
            if L == layer:
                return KVConfig(key=_with_bits(self.key, kb), value=_with_bits(self.value, vb), scheme=self.scheme)
        if not self.layer_bits:
            return self
        return KVConfig(key=self.key, value=self.value, scheme=self.scheme)

    def bits_per_value(self, n_layers: int) -> float:
        """Nominal bits per value over ``n_layers`` layers of equal size (codes, scales, zero points)."""
        total = 0.0
        for L in range(n_layers):
            c = self.for_layer(L)
            total += c.key.bits_per_value() + c.value.bits_per_value()
        return total / (2 * n_layers)

    @property
    def fallback(self) -> IntCodec:
        v = self.value
        return IntCodec(group_size=v.group_size, scheme=v.scheme, bits=v.bits, axis="token", rotate=False, sinks=0,
                        n_threads=v.n_threads)

    def codecs(self) -> dict:
        """Every codec a tensor may get, by the name a packed file records (``key.b4``: a per-layer width)."""
        out = {"key": self.key, "value": self.value, "fallback": self.fallback}
        for _, kb, vb in self.layer_bits:
            for kind, base, b in (("key", self.key, kb), ("value", self.value, vb)):
                if b != base.bits:
                    out[f"{kind}.b{b}"] = _with_bits(base, b)
        return out

    def codec_for(self, name: str, shape=None) -> Tuple[str, IntCodec]:
        """(kind, codec) for a tensor: 'key' or 'value' by name ('key.b4' where its layer has other bits),
        'fallback' where that codec cannot take the shape."""
        kind = "key" if is_key_tensor(name) else "value"
        layer_cfg = self.for_layer(layer_of(name)) if self.layer_bits else self
        codec = layer_cfg.key if kind == "key" else layer_cfg.value
        if shape is not None and not codec.supports(shape):
            return "fallback", self.fallback
        base = self.key if kind == "key" else self.value
        return (kind if codec.bits == base.bits else f"{kind}.b{codec.bits}"), codec

    def get_config(self) -> dict:
        cfg = {"scheme": self.scheme, "key": self.key.get_config(), "value": self.value.get_config()}
        if self.layer_bits:
            cfg["layer_bits"] = [list(r) for r in self.layer_bits]
        return cfg

    def describe(self) -> str:
        def one(c: IntCodec) -> str:
            s = f"{c.bits}-bit {c.scheme[:4]} g{c.group_size} per-{c.axis}"
            if c.rotate:
                s += " +hadamard"
            if c.sinks:
                s += f" +{c.sinks} sink"
            return s
        text = f"{self.scheme}: K {one(self.key)}, V {one(self.value)}"
        if self.layer_bits:
            text += "; per layer K/V bits " + ", ".join(f"{L}:{kb}/{vb}" for L, kb, vb in self.layer_bits)
        return text


def _with_bits(codec: IntCodec, bits: int) -> IntCodec:
    if bits == codec.bits:
        return codec
    return IntCodec.from_config({**codec.get_config(), "bits": bits, "n_threads": codec.n_threads})
