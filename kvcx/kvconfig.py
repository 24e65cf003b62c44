"""KV-cache codec settings: one codec for keys, one for values, and the named schemes.

Schemes (``--scheme``):

- ``reference``: the reference design, bit-exact: symmetric INT4, groups along
  each token's values, FP16 scale (4.25 bits/value at groups of 64).
- ``symmetric`` / ``asymmetric``: that scheme on keys and values, groups along tokens' values.
- ``kivi``: keys asymmetric per channel (groups along tokens), values asymmetric per token.
- ``kvcx`` (default): keys asymmetric per channel (groups of 64 tokens) with the first token (the
  attention sink) kept exact; values symmetric per token after a Hadamard rotation of head_dim.
  Chosen from bench/bench_quality.py; see README "Choosing the default".

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
}
SCHEME_NAMES = tuple(_SCHEMES)

_KEY_WORDS = {"key", "keys", "k"}
_VALUE_WORDS = {"value", "values", "v"}
# transformers' legacy tuples: past_key_values.<layer>.<0 = key | 1 = value>
_LEGACY_RE = re.compile(r"(^|[._])past_key_values?[._](\d+)[._]([01])$", re.IGNORECASE)


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


@dataclass(frozen=True)
class KVConfig:
    key: IntCodec
    value: IntCodec
    scheme: str = "custom"

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

    @property
    def fallback(self) -> IntCodec:
        v = self.value
        return IntCodec(group_size=v.group_size, scheme=v.scheme, bits=v.bits, axis="token", rotate=False, sinks=0,
                        n_threads=v.n_threads)

    def codecs(self) -> dict:
        return {"key": self.key, "value": self.value, "fallback": self.fallback}

    def codec_for(self, name: str, shape=None) -> Tuple[str, IntCodec]:
        """(kind, codec) for a tensor: 'key' or 'value' by name, 'fallback' where that codec cannot take the shape."""
        kind = "key" if is_key_tensor(name) else "value"
        codec = self.key if kind == "key" else self.value
        if shape is not None and not codec.supports(shape):
            return "fallback", self.fallback
        return kind, codec

    def get_config(self) -> dict:
        return {"scheme": self.scheme, "key": self.key.get_config(), "value": self.value.get_config()}

    def describe(self) -> str:
        def one(c: IntCodec) -> str:
            s = f"{c.bits}-bit {c.scheme[:4]} g{c.group_size} per-{c.axis}"
            if c.rotate:
                s += " +hadamard"
            if c.sinks:
                s += f" +{c.sinks} sink"
            return s
        return f"{self.scheme}: K {one(self.key)}, V {one(self.value)}"
