"""The cache layers kvcx leaves to transformers' own classes (linear attention's and recurrent states, a layer type
kvcx cannot pack kept with ``unsupported="keep"``, a layer an engine keeps exact), as KvcxCache and StaticKvcxCache
build them, and the bytes such layers (and transformers' caches) hold."""
from __future__ import annotations

import torch
import transformers

from kvcx.cache.layer_types import STATE, LayerSpec
from kvcx.errors import KvcxError


def transformers_layer_class(spec_or_type, which: str = "DYNAMIC"):
    """The cache layer class transformers' ``DynamicCache`` (``which="DYNAMIC"``) or ``StaticCache`` ("STATIC")
    builds for a layer type (a :class:`LayerSpec`'s, or a name), or None where this transformers maps none; a
    KvcxError where it has no layer type mapping at all (before hybrid caches: older than kvcx supports hybrids
    on)."""
    import transformers.cache_utils as cu

    mapping = getattr(cu, f"{which}_LAYER_TYPE_MAPPING", None)
    name = getattr(spec_or_type, "type", spec_or_type)
    if mapping is None:
        raise KvcxError(f"transformers {transformers.__version__} has no cache layer classes by layer type; layer "
                        f"type {name!r} needs a transformers whose caches build hybrid models' layers: pip install "
                        "-U transformers")
    if getattr(spec_or_type, "kind", None) == STATE:   # no keys and values: whatever placeholder this release has
        return mapping.get(name) or mapping.get("dummy") or mapping.get("linear_attention")
    return mapping.get(name)


def layer_kwargs(config, spec: LayerSpec) -> dict:
    """What transformers gives the cache layer class of ``spec`` (its window, its states, its config): the
    arguments ``get_layer_types_and_kwargs`` yields for the layer (a list of them a layer from 5.19; before, one
    dict that every layer class is given whole)."""
    import transformers.cache_utils as cu

    get = getattr(cu, "get_layer_types_and_kwargs", None)
    if get is None:
        return {"number_of_states": getattr(config, "number_of_conv_states", 1) or 1} if spec.kind == STATE else {}
    kwargs = get(config)[1]
    return dict(kwargs) if isinstance(kwargs, dict) else kwargs[spec.index]


def layer_bytes(layer) -> int:
    """Bytes of every tensor a cache layer holds as an attribute (or in a dict attribute): what transformers' own
    layer classes keep (keys and values; linear attention's conv and recurrent states; a compressed layer's
    buffers), counted the same way whatever the class."""
    seen, n = set(), 0
    for v in vars(layer).values():
        for t in (v.values() if isinstance(v, dict) else (v,)):
            if isinstance(t, torch.Tensor) and t.numel() and id(t) not in seen:
                seen.add(id(t))
                n += t.numel() * t.element_size()
    return n


def dynamic_cache_bytes(cache) -> int:
    """Bytes held by a transformers cache's layers (DynamicCache: keys + values of every layer; linear attention's
    states where it has such layers)."""
    return int(sum(layer_bytes(layer) for layer in cache.layers))
