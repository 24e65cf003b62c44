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

_KEY_RE = re.compile(r"key|(^|[^a-z])k([^a-z]|$)", re.IGNORECASE)


def is_key_tensor(name: str) -> bool:
    """Tensors whose name says 'key' (``layer_3_key``, ``k_cache.0``) get the key codec."""
    return bool(_KEY_RE.search(name))


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
