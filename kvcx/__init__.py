"""kvcx: packed INT4 KV-cache compression with a Cython/OpenMP core."""
__version__ = "0.1.0"

from kvcx.errors import CodecError, DatasetError, FormatError, KvcxError, ModelError  # noqa: E402
from kvcx.codec import Int4Codec, IntCodec, Packed, WidthCodec  # noqa: E402
from kvcx.convert import to_float16, to_float32  # noqa: E402
from kvcx.metrics import quality_metrics  # noqa: E402

__all__ = ["__version__", "KvcxError", "CodecError", "FormatError", "ModelError", "DatasetError",
           "IntCodec", "Int4Codec", "WidthCodec", "Packed", "quality_metrics", "to_float16", "to_float32"]
