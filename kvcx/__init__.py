"""kvcx: packed low-bit KV-cache compression with a Cython/OpenMP core, validated by real perplexity.

The package is layered (docs/ARCHITECTURE.md): the kernels behind :mod:`kvcx.codecs` (the only door to
them), byte layouts in :mod:`kvcx.formats`, the file API in :mod:`kvcx.api`, and two wings that import
torch lazily: :mod:`kvcx.cache` (``KvcxCache`` for transformers) and :mod:`kvcx.quality` (models,
perplexity validation, calibration); :mod:`kvcx.cli` sits on top.

The codecs' names below load the kernels when first used (``kvcx.IntCodec``), not when ``kvcx`` is imported, so
that the command line can report a kernel setting it cannot honour (``$KVCX_KERNELS``) as one line.
"""
import importlib

from kvcx.errors import CodecError, DatasetError, FormatError, KvcxError, ModelError, SlowPathWarning
from kvcx.version import VERSION as __version__

_LAZY = {**{n: "kvcx.codecs" for n in ("Codec", "IntCodec", "KVConfig", "Packed", "WidthCodec", "get_codec",
                                       "register_codec")},
         "to_float16": "kvcx.codecs.convert", "to_float32": "kvcx.codecs.convert",
         "quality_metrics": "kvcx.codecs.metrics"}

__all__ = ["__version__", "KvcxError", "CodecError", "FormatError", "ModelError", "DatasetError",
           "SlowPathWarning", "Codec", "IntCodec", "WidthCodec", "KVConfig", "Packed", "get_codec", "register_codec",
           "quality_metrics", "to_float16", "to_float32"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcx' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
