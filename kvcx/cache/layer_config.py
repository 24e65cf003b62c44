"""How a :class:`~kvcx.cache.KvcxCache` resolves what it was given into its layers' codecs: a press composed by
``+`` (or carried by a calibrated plan) split from the codec, the codecs moved to a backend, and a codec that
cannot take the model's chunks replaced by the fallback when the cache is made. (The configs are
KVConfig objects, taken as given: this module sits below the codecs' config in the
import floors.)"""
from __future__ import annotations

from typing import Optional, Tuple

from kvcx.codecs.backends import TRITON, backend_takes
from kvcx.presses import Press, PressedSetting, split_scheme
from kvcx.errors import KvcxError


def pressed(kv_config, scheme: str) -> Tuple[object, Optional[Press], str]:
    """(config or None, press or None, the scheme's codec part) of KvcxCache's ``kv_config`` and ``scheme``:
    ``scheme="kvcx+snapkv:0.5"`` -> (None, snapkv:0.5, "kvcx"); a :class:`PressedSetting` (a plan with keep
    ratios) -> (its KVConfig, its press, scheme)."""
    if isinstance(kv_config, PressedSetting):
        if not hasattr(kv_config.codec, "for_layer"):   # not a kvcx KVConfig: a peer's, or none
            raise KvcxError(f"KvcxCache packs the tokens press {kv_config.press.spec} keeps: give it with a kvcx "
                            "codec (e.g. scheme='kvcx+snapkv:0.5'); DynamicCache holds tokens at full precision")
        return kv_config.codec, kv_config.press, scheme
    if kv_config is not None:
        return kv_config, None, scheme
    press, codec = split_scheme(str(scheme))
    if press is not None and codec is None:
        raise KvcxError(f"KvcxCache(scheme={scheme!r}): KvcxCache packs the tokens a press keeps; compose it with a "
                        f"codec, e.g. scheme='kvcx+{press.spec}' (transformers' DynamicCache holds tokens at full "
                        "precision)")
    return None, press, codec or scheme


def latent_rope_codec(kv, residual_length: int):
    """The codec of an MLA layer's shared RoPE key in a KvcxCache: :meth:`KVConfig.rope_key_codec
    <kvcx.codecs.KVConfig.rope_key_codec>` (a width per channel at 8 bits where the values' codes are fewer; the
    residual's tokens a group where the keys are grouped per token), so the cache and ``kvcx validate`` code it
    alike."""
    return kv.rope_key_codec(residual_length)


def on_backend(kv, backend: str, layers: int):
    """``kv`` with its codecs on ``backend``; KvcxError when a layer's codecs have no such backend. (On the Triton
    backend a layer whose codecs the fused attention does not read, E8P values or widths keys, decodes its packed
    context on the device each step.)"""
    if backend == TRITON:
        bad = sorted({c.describe() for i in range(layers) for c in (kv.for_layer(i).key, kv.for_layer(i).value)
                      if not backend_takes(c, TRITON)})
        if bad:
            raise KvcxError(f"KvcxCache(backend='triton') runs 4-bit integer, E8P and widths codecs; this config has "
                            f"{', '.join(bad)}: pass backend=None (by device) or 'cpu', or a scheme of those "
                            "(kvcx, reference, kivi fused; kvcx2v, kvcx4w decoded on the device)")
    return kv.with_backend(backend)


def fitted(kv, kv_heads, residual_length: int, key_dim, value_dim=None):
    """``kv`` with the fallback codec (as ``kvcx compress`` takes it) for a kind whose codec cannot take this
    layer's chunks, e.g. a rotation over a head dim that is not a power of two (keys and values may differ in
    width: MLA): decided when the cache is made, not at its first packing."""
    value_dim = key_dim if value_dim is None else value_dim
    if not (kv_heads and key_dim and value_dim):
        return kv
    key = kv.key if kv.key.supports((1, int(kv_heads), residual_length, int(key_dim))) else kv.fallback
    value = kv.value if kv.value.supports((1, int(kv_heads), residual_length, int(value_dim))) else kv.fallback
    if key is kv.key and value is kv.value:
        return kv
    return type(kv)(key=key, value=value, scheme=kv.scheme)
