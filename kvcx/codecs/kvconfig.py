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

MLA layers: ``KVConfig(..., latent_layers=(0, 1))`` names the layers of multi-head latent attention (DeepSeek V2/V3,
Kimi K2.5), whose cache transformers fills with the compressed latent as keys and the shared RoPE key as values. The
latent takes the layer's key codec; the RoPE key, a key every query head reads, takes :meth:`KVConfig.rope_key_codec`
(a width per channel at 8 bits, the codec name ``value.rope``) where the values' own codec has fewer bits.
``kvcx validate`` fills them in from the model's config (the gate codes what :class:`~kvcx.cache.KvcxCache` codes).

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
from kvcx.codecs.config_fields import (  # noqa: F401  (tag_of, widths_tag, widths_bits: imported from here too)
    WIDTHS_SUFFIX,
    check_key_weights,
    check_layer_bits,
    check_layers,
    check_variants,
    tag_of,
    widths_bits,
    widths_tag,
)
from kvcx.codecs.intcodec import BITS, IntCodec
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


GUARD_BITS = 8   # the key width the retrieval guards give the layers they guard
ROPE_KEY_BITS = 8   # an MLA layer's shared RoPE key: a width per channel at 8 bits (KVConfig.rope_key_codec)
ROPE_NAME = "value.rope"   # the codec name a packed file records for an MLA layer's RoPE key
DEFAULT_GUARD_GROUP = 64   # the guard's key groups (tokens) where the scheme's keys are grouped per token
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
    latent_layers: tuple = ()  # MLA layers: their keys are the compressed latent, their values the shared RoPE key,
    #                            coded by rope_key_codec() (with_latent_layers; kvcx validate fills them in)

    def __post_init__(self):
        object.__setattr__(self, "layer_bits", check_layer_bits(self.layer_bits))
        object.__setattr__(self, "keep_layers", check_layers(self.keep_layers, "keep_layers", "kept exact"))
        object.__setattr__(self, "latent_layers", check_layers(self.latent_layers, "latent_layers",
                                                               "a model's MLA layers"))
        object.__setattr__(self, "key_weights", check_key_weights(self.key_weights))
        object.__setattr__(self, "key_rope", check_key_rope(self.key_rope))
        if self.key_weights and not self.key.takes_weights:
            raise CodecError("key_weights choose per-channel widths; they need a widths key codec "
                             "(--scheme kvcx2w), not " + repr(self.key))
        if self.value.takes_weights and not self.latent_layers:   # an MLA layer's view (for_layer): its RoPE key
            raise CodecError("per-channel widths are for keys (and an MLA layer's RoPE key: latent_layers); give "
                             "values an IntCodec")
        object.__setattr__(self, "variants", check_variants(self.variants))
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
        return all(n.startswith("key.") and n.endswith(WIDTHS_SUFFIX) for n, _ in self.variants) and \
            all(isinstance(kb, str) and kb.endswith(WIDTHS_SUFFIX) and vb == own for _, kb, vb in self.layer_bits)

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
                        keep_layers=self.keep_layers, key_rope=self.key_rope, latent_layers=self.latent_layers)

    def engine_layers(self, n_layers: int, hybrid: bool) -> "KVConfig":
        """This config as its engine runs it on a model of ``n_layers`` layers (``hybrid``: with linear-attention
        or recurrent layers): vLLM's TurboQuant schemes keep the first and last two layers of a dense model exact
        (``--kv-cache-dtype-skip-layers``, set by ``get_boundary_skip_layers``; none on hybrids). Other schemes, or
        a config whose kept layers are already set, are returned as they are."""
        if self.scheme not in _turboquant.PRESETS or self.keep_layers:
            return self
        kept = () if hybrid else _turboquant.boundary_layers(n_layers)
        return dataclasses.replace(self, keep_layers=kept) if kept else self

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
                                 "key_rope", "latent_layers"}
        if unknown:
            raise CodecError(f"unknown kvcx config fields {sorted(unknown)}; known: scheme, key, value, layer_bits, "
                             "variants, key_weights, keep_layers, key_rope, latent_layers")
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
                   keep_layers=config.get("keep_layers", ()), key_rope=config.get("key_rope"),
                   latent_layers=config.get("latent_layers", ()))

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

    def with_latent_layers(self, layers) -> "KVConfig":
        """This config on a model whose ``layers`` are multi-head latent attention (their values: the shared RoPE key,
        coded by :meth:`rope_key_codec`); ``()``: none."""
        return dataclasses.replace(self, latent_layers=tuple(layers))

    def rope_key_codec(self, tokens: int = DEFAULT_GUARD_GROUP) -> Codec:
        """The codec of an MLA layer's shared RoPE key: what transformers hands the layer's cache as its values (the
        compressed latent is its keys). It is a key, one head every query head reads, which carries the position part
        of every score: at the values' 4-bit codes it held most of a trained DeepSeek-V3-shaped model's error
        (docs/results/families-layer-plan.md: on 8-bit codes its KL 0.0041 -> 0.00012 nats, the latent's on 8 bits
        none of it), and FlashMLA's FP8 cache keeps this part in BF16 for the same reason. kvcx's own schemes give it
        the retrieval guard's key codec: a width per channel at :data:`ROPE_KEY_BITS` bits
        (:class:`~kvcx.codecs.widths.WidthCodec`: groups of the keys' tokens, or of ``tokens`` where the keys are
        grouped per token: KvcxCache passes its residual length; the values' sinks, threads and backend), which the
        fused CPU kernels and the Triton codecs read. Values of 8 bits or more, or an engine's format (fp8, q4_0,
        TurboQuant: as the engine writes it), are returned as they are."""
        v = self.value
        if not _below_rope_bits(v):
            return v
        group = self.key.token_block if self.key.token_block > 1 else tokens
        return WidthCodec(bits=ROPE_KEY_BITS, group_size=group, sinks=v.sinks, n_threads=v.n_threads,
                          backend=getattr(v, "backend", None))

    def _latent_value(self, codec) -> Codec:
        """An MLA layer's values codec: :meth:`rope_key_codec` where the layer's own (``codec``) has fewer bits."""
        return self.rope_key_codec() if _below_rope_bits(codec) else codec

    def with_threads(self, n_threads: Optional[int]) -> "KVConfig":
        return dataclasses.replace(self, key=self.key.with_threads(n_threads), value=self.value.with_threads(n_threads),
                                   variants=tuple((n, c.with_threads(n_threads)) for n, c in self.variants))

    def with_backend(self, backend: Optional[str]) -> "KVConfig":
        """This config with its codecs working torch tensors on ``backend`` (see kvcx.codecs.backends)."""
        return dataclasses.replace(self, key=self.key.with_backend(backend), value=self.value.with_backend(backend),
                                   variants=tuple((n, c.with_backend(backend)) for n, c in self.variants))

    def for_layer(self, layer: Optional[int]) -> "KVConfig":
        """This config with the key and value codecs of ``layer`` (no per-layer widths left; an MLA layer's values:
        its RoPE key's codec, :meth:`rope_key_codec`)."""
        key, value = self.key, self.value
        for L, kb, vb in self.layer_bits:
            if L == layer:
                key, value = self.codec_at("key", kb), self.codec_at("value", vb)
        if not (self.layer_bits or self.latent_layers):
            return self
        latent = layer in self.latent_layers
        return KVConfig(key=key, value=self._latent_value(value) if latent else value, scheme=self.scheme,
                        key_rope=self.key_rope, latent_layers=(layer,) if latent else ())

    def bits_per_value(self, layers) -> float:
        """Nominal bits per value over ``layers`` (a count: layers 0..n-1; or the layer indices, a hybrid model's
        attention layers) of equal size (codes, scales, zero points). An MLA layer's RoPE key is narrower than its
        latent (64 channels of 576 in DeepSeek V3): its values count at the layer's own selection here; the bytes
        a run measures count it as written."""
        layers = range(layers) if isinstance(layers, int) else list(layers)
        plain = dataclasses.replace(self, latent_layers=()) if self.latent_layers else self
        total = 0.0
        for L in layers:
            c = plain.for_layer(L)
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
        for L in self.latent_layers:
            label, codec = self.codec_for(f"layer_{L}_value")
            if label == ROPE_NAME:
                out[ROPE_NAME] = codec
        return out

    def codec_for(self, name: str, shape=None) -> Tuple[str, Optional[Codec]]:
        """(kind, codec) for a tensor: 'key' or 'value' by name ('key.b4' where its layer selects another
        codec), 'fallback' where that codec cannot take the shape, ('kept', None) in a layer kept exact."""
        if self.keep_layers and layer_of(name) in self.keep_layers:
            return "kept", None
        kind = "key" if is_key_tensor(name) else "value"
        base = self.key if kind == "key" else self.value
        label, codec = kind, base
        layer = layer_of(name) if self.layer_bits or self.latent_layers else None
        for L, kb, vb in self.layer_bits:
            if L == layer:
                label, codec = self._name(kind, kb if kind == "key" else vb)
        if kind == "value" and layer in self.latent_layers:
            rope = self._latent_value(codec)
            if rope is not codec:
                label, codec = ROPE_NAME, rope
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
        if self.latent_layers:
            cfg["latent_layers"] = list(self.latent_layers)
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
        if self.latent_layers:
            rope = self.codecs().get(ROPE_NAME)
            text += (f"; MLA layers {', '.join(map(str, self.latent_layers))}: K the latent, V the RoPE key"
                     + (f" ({rope.describe()})" if rope is not None else ""))
        return text

    def with_key_rope(self, key_rope) -> "KVConfig":
        """This config with its keys coded in ``key_rope``'s frame (None: as the model hands them)."""
        return dataclasses.replace(self, key_rope=key_rope)


def _below_rope_bits(codec) -> bool:
    """Whether kvcx's own codes (integer or E8P) give ``codec`` fewer bits than an MLA RoPE key gets; an engine's
    format is coded as the engine writes it."""
    return isinstance(codec, (IntCodec, _lattice.E8PCodec)) and codec.bits < ROPE_KEY_BITS


def _with_bits(codec: IntCodec, bits: int) -> IntCodec:
    if bits == codec.bits:
        return codec
    return IntCodec.from_config({**codec.get_config(), "bits": bits, "n_threads": codec.n_threads})
