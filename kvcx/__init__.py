"""kvcx: packed low-bit KV-cache compression with a Cython/OpenMP core, validated by real perplexity.

The package is layered (docs/ARCHITECTURE.md): the kernels behind :mod:`kvcx.codecs` (the only door to
them), byte layouts in :mod:`kvcx.formats`, the file API in :mod:`kvcx.api`, and two wings that import
torch lazily: :mod:`kvcx.cache` (``KvcxCache`` for transformers) and :mod:`kvcx.quality` (models,
perplexity validation, calibration); :mod:`kvcx.cli` sits on top.
"""
from kvcx.codecs import Codec, IntCodec, KVConfig, Packed, WidthCodec, get_codec, register_codec  # noqa: E402
from kvcx.codecs.convert import to_float16, to_float32  # noqa: E402
from kvcx.codecs.metrics import quality_metrics  # noqa: E402
from kvcx.errors import CodecError, DatasetError, FormatError, KvcxError, ModelError, SlowPathWarning  # noqa: E402
from kvcx.version import VERSION as __version__  # noqa: E402

__all__ = ["__version__", "KvcxError", "CodecError", "FormatError", "ModelError", "DatasetError",
           "SlowPathWarning", "Codec", "IntCodec", "WidthCodec", "KVConfig", "Packed", "get_codec", "register_codec",
           "quality_metrics", "to_float16", "to_float32"]
