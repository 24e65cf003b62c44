"""The cache wing: KV caches that stay packed while a model generates.

- :mod:`kvcx.cache.kvcx_cache`: :class:`KvcxCache` for transformers (imports torch and transformers);
- :mod:`kvcx.cache.static_cache`: :class:`StaticKvcxCache`, whose decode steps replay from CUDA graphs (the
  Triton kernels; buffers allocated once for ``max_cache_len``);
- :mod:`kvcx.cache.attention_fn`: the ``"kvcx"`` attention implementation it registers;
- :mod:`kvcx.cache.store`: a layer's packed stores and the fused decode step over them (NumPy);
- :mod:`kvcx.cache.fused`: the fused attention kernel's wrapper
  (torch <-> NumPy without copies: :mod:`kvcx.codecs.tensors`).

``from kvcx.cache import KvcxCache`` imports torch and transformers then, not before.
"""
__all__ = ["KvcxCache", "StaticKvcxCache", "dynamic_cache_bytes"]


def __getattr__(name):
    if name == "StaticKvcxCache":
        from kvcx.cache import static_cache

        return static_cache.StaticKvcxCache
    if name in __all__:
        from kvcx.cache import kvcx_cache

        return getattr(kvcx_cache, name)
    raise AttributeError(f"module 'kvcx.cache' has no attribute {name!r}")
