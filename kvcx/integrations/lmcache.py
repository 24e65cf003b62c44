"""kvcx as an LMCache serde: KV chunks compressed by the Cython kernels on their way to a shared store.

    import kvcx.integrations.lmcache as kvcx_lmcache
    kvcx_lmcache.register()          # once per process, before LMCache builds its L2 adapters

then, in an L2 adapter's config::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "kvcx", "scheme": "kvcx", "group_size": 64, "head_dim": 64}}

Options (all optional but ``head_dim`` when the model's head size is not 64): ``scheme`` (kvcx,
reference, symmetric, asymmetric, kivi), ``group_size``, ``bits``, ``sinks``, ``rotate``, ``head_dim``,
``threads`` (OpenMP threads per chunk; default all cores), ``max_workers`` (LMCache's serde
worker threads, default 1) and ``backend`` (``"triton"`` or ``"cpu"``; default: by where the chunk lives).

A chunk that lives on the GPU (a CUDA memory object) is encoded and decoded there by the Triton kernels:
only its packed sections cross to the host buffer (or back), never the uncompressed chunk, and the bytes
are the ones the CPU kernels write, so a chunk written on the GPU decodes on the CPU and back, bit for bit.

Each chunk is bound to the store key LMCache writes it under: a valid chunk read under another key (a
mix-up in the store no checksum sees) fails the load instead of returning another chunk's tensor.

The pair is pure and synchronous, as LMCache's serdes are: ``serialize`` views the source memory
object's bytes as a NumPy array (no copy) and runs the kernels from it straight into the destination
buffer; ``deserialize`` decodes straight into the destination object. The size is exact
(``estimate_serialized_size``), as LMCache's FS and RESP adapters require. Every chunk carries a
magic, a wire version, its shape, dtype and codec settings and a CRC-32 (see :mod:`kvcx.formats.chunk`), so
it always decodes with what wrote it, and a foreign or damaged payload is refused with an error.

Needs ``lmcache==0.5.6`` and torch (``pip install kvcx[lmcache]``; ``kvcx[gpu]`` for the Triton kernels);
torch is used only to view memory objects' buffers, never for math.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvcx.codecs.dtypes import BFLOAT16, is_int
from kvcx.codecs.kvconfig import SCHEME_NAMES, KVConfig
from kvcx.errors import KvcxError
from kvcx.formats.chunk import ChunkCodec

try:
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
    from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
    from lmcache.v1.memory_management import MemoryObj
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise KvcxError(f"kvcx.integrations.lmcache needs LMCache and torch ({exc.name} is missing): "
                    "pip install torch==2.13.0 lmcache==0.5.6 (or kvcx[lmcache])") from None

SERDE_NAME = "kvcx"
_OPTIONS = {"scheme", "group_size", "bits", "sinks", "rotate", "head_dim", "threads", "max_workers", "backend"}
_TORCH_TO_NUMPY = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                   torch.bfloat16: BFLOAT16}


class KvcxSerdeError(KvcxError):
    """A chunk, buffer or serde option LMCache handed to kvcx that it cannot take."""


def _int_option(opts: dict, name: str, lo: int, hi: int, default=None):
    v = opts.get(name, default)
    if v is None:
        return None
    if not is_int(v) or not lo <= v <= hi:
        raise KvcxSerdeError(f"serde option {name!r} must be an integer from {lo} to {hi}, got {v!r}")
    return v


def chunk_codec_from_options(options: dict) -> tuple:
    """(ChunkCodec, max_workers) from a serde config's options (``"type"`` already removed)."""
    if not isinstance(options, dict):
        raise KvcxSerdeError(f"the kvcx serde options must be an object, got {type(options).__name__}")
    unknown = sorted(set(options) - _OPTIONS - {"type"})
    if unknown:
        raise KvcxSerdeError(f"unknown kvcx serde options {unknown}; known: {sorted(_OPTIONS)}")
    scheme = options.get("scheme", "kvcx")
    if scheme not in SCHEME_NAMES:
        raise KvcxSerdeError(f"serde option 'scheme' must be one of {', '.join(SCHEME_NAMES)}, got {scheme!r}")
    rotate = options.get("rotate")
    if rotate is not None and not isinstance(rotate, bool):
        raise KvcxSerdeError(f"serde option 'rotate' must be true or false, got {rotate!r}")
    try:
        cfg = KVConfig.from_scheme(scheme, group_size=_int_option(options, "group_size", 1, 1 << 16),
                                   bits=_int_option(options, "bits", 1, 64), sinks=_int_option(options, "sinks", 0, 2 ** 31 - 1),
                                   rotate=rotate, n_threads=_int_option(options, "threads", 1, 1024))
        cfg = cfg.with_backend(options.get("backend"))
        codec = ChunkCodec(cfg, head_dim=_int_option(options, "head_dim", 1, 65535, default=64))
    except KvcxError as exc:
        raise KvcxSerdeError(f"kvcx serde options: {exc}") from None
    return codec, _int_option(options, "max_workers", 1, 64, default=1)


def _layout_of(shapes, dtypes, where: str):
    if len(shapes) != 1 or len(dtypes) != 1:
        raise KvcxSerdeError(f"{where}: the kvcx serde takes single-tensor KV_2LTD chunks, got {len(shapes)} tensors")
    if dtypes[0] not in _TORCH_TO_NUMPY:
        raise KvcxSerdeError(f"{where}: dtype {dtypes[0]} is not bfloat16, float16 or float32")
    return tuple(int(s) for s in shapes[0]), _TORCH_TO_NUMPY[dtypes[0]]


def _bytes_of(obj: MemoryObj, where: str) -> np.ndarray:
    """The memory object's bytes as a writeable uint8 NumPy view (no copy)."""
    t = obj.tensor
    if t is None or t.device.type != "cpu":
        raise KvcxSerdeError(f"{where}: the kvcx serde needs a CPU memory object with a tensor")
    if not t.is_contiguous():
        raise KvcxSerdeError(f"{where}: the memory object's tensor is not contiguous")
    return t.view(torch.uint8).reshape(-1).numpy()


def _kv_view(obj: MemoryObj, where: str, backend: Optional[str] = None):
    """The chunk as a NumPy view of a CPU memory object, or as a torch view (no copy) where it lives on a
    device or the serde's backend is Triton (then the codecs work it there)."""
    shapes = obj.get_shapes() if obj.meta.shapes is not None else [obj.get_shape()]
    dtypes = obj.get_dtypes() if obj.meta.dtypes is not None else [obj.get_dtype()]
    shape, dtype = _layout_of(shapes, dtypes, where)
    t = obj.tensor
    if t is not None and (t.device.type != "cpu" or backend == "triton"):
        if not t.is_contiguous():
            raise KvcxSerdeError(f"{where}: the memory object's tensor is not contiguous")
        flat, n = t.view(torch.uint8).reshape(-1), int(np.prod(shape)) * dtype.itemsize
        if flat.numel() < n:
            raise KvcxSerdeError(f"{where}: the memory object holds {flat.numel()} bytes, its layout needs {n}")
        return flat[:n].view(dtypes[0]).view(shape)
    raw = _bytes_of(obj, where)
    n = int(np.prod(shape)) * dtype.itemsize
    if raw.size < n:
        raise KvcxSerdeError(f"{where}: the memory object holds {raw.size} bytes, its layout needs {n}")
    return raw[:n].view(dtype).reshape(shape)


def key_bytes(key: Optional[ObjectKey]) -> Optional[bytes]:
    """What a chunk is bound to: every field of LMCache's ObjectKey (model, rank, group, salt, chunk hash)."""
    if key is None:
        return None
    fields = (key.model_name, key.kv_rank, getattr(key, "object_group_id", 0), getattr(key, "cache_salt", ""))
    return "\x00".join(map(str, fields)).encode("utf-8") + b"\x00" + bytes(key.chunk_hash)


def _where(key: Optional[ObjectKey]) -> str:
    if key is None:
        return "KV chunk"
    return f"KV chunk {key.chunk_hash.hex()[:16]} of {key.model_name!r}"


class KvcxSerializer(Serializer):
    """Packs an LMCache KV_2LTD chunk with kvcx (see :class:`kvcx.formats.chunk.ChunkCodec`)."""

    def __init__(self, codec: Optional[ChunkCodec] = None):
        self.codec = codec or ChunkCodec()

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        where = _where(key)
        chunk = _kv_view(src, where, self.codec.config.value.backend)
        return self.codec.encode_into(chunk, _bytes_of(dst, where), where, key=key_bytes(key))

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        shape, dtype = _layout_of(layout_desc.shapes, layout_desc.dtypes, "layout")
        return self.codec.serialized_size(shape, dtype)


class KvcxDeserializer(Deserializer):
    """Decodes a kvcx chunk into an LMCache KV_2LTD memory object (settings from the chunk itself)."""

    def __init__(self, codec: Optional[ChunkCodec] = None):
        self.codec = codec or ChunkCodec()

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        where = _where(key)
        out = _kv_view(dst, where, self.codec.config.value.backend)
        self.codec.decode_into(_bytes_of(src, where), out, where, key=key_bytes(key))


def create_serde(options: dict) -> SerdeProcessor:
    """LMCache's factory signature: the serde config's options -> an async serde processor."""
    codec, workers = chunk_codec_from_options({k: v for k, v in options.items() if k != "type"})
    return AsyncSerdeProcessor(KvcxSerializer(codec), KvcxDeserializer(codec), max_workers=workers)


_REGISTERED = set()   # the names this module registered create_serde under


def register(name: str = SERDE_NAME) -> str:
    """Register the kvcx serde with LMCache under ``name`` (through LMCache's public
    ``register_serde_factory``; calling it again for a name kvcx registered does nothing)."""
    if name in _REGISTERED and name in get_registered_serde_types():
        return name
    if name in get_registered_serde_types():
        raise KvcxSerdeError(f"an LMCache serde named {name!r} is already registered; pass another name")
    register_serde_factory(name, create_serde)
    _REGISTERED.add(name)
    return name
