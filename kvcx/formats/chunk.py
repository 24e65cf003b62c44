"""A KV chunk as one self-describing byte string: the wire format of the LMCache serde.

A chunk is LMCache's ``KV_2LTD`` layout: ``[2, layers, tokens, kv_heads * head_dim]`` (keys at
index 0, values at 1), BF16, FP16 or FP32. :class:`ChunkCodec` packs it into a buffer whose size is
known exactly from the shape, dtype and settings (:meth:`ChunkCodec.serialized_size`), running the
kernels straight from the chunk's memory into the destination buffer (no intermediate copies of
the data beyond the exact sink tokens), and decodes such a buffer straight into a chunk.

Byte layout (all integers little-endian; every section starts on an 8-byte boundary)::

    0   magic  b"KVCX"          4   u16 wire version (2)     6   u16 header bytes (64)
    8   u8 dtype (0 F32, 1 F16, 2 BF16)   9  u8 flags (0)    10  u16 reserved (0)
    12  u32 layers   16 u32 tokens   20 u32 kv_heads   24 u32 head_dim
    28  key codec:   u8 bits, u8 asymmetric, u8 axis (0 token, 1 channel), u8 rotate,
                     u16 group_size, u16 reserved (0), u32 sinks
    40  value codec: the same 12 bytes
    52  u32 checksum: CRC-32C (Castagnoli) over header bytes 0..51 and 56..63, then the little-endian
        u32 CRC-32C of each 64 KiB block of the payload in order (blocks are checked in parallel)
    56  u32 payload bytes (after the header)
    60  u32 key digest: CRC-32C of the store key the chunk was written under, with its low bit set;
        0 when the writer gave no key (wire version 1 has 0 here: its chunks are read, unbound)
    64  key sections: codes, scales, zeros (asymmetric), sinks (sinks > 0), each padded to 8
        value sections: the same

Keys are seen as ``(layers, tokens, kv_heads * head_dim)``: per-channel groups run along tokens
for every (head, dim) channel, and sink tokens are the chunk's first tokens, exactly as
``kvcx compress`` does on ``[1, kv_heads, tokens, head_dim]`` tensors. A codec that rotates is
applied per head, each layer seen as ``(tokens * kv_heads, head_dim)`` rows (its sink tokens are then
the first ``sinks * kv_heads`` rows, the same bytes); it cannot use per-channel groups. Token-axis
groups of at most ``head_dim`` values that divide it are the same groups as in a file; the default
scheme decodes bit for bit as ``kvcx compress`` does.

A chunk written with a key (the LMCache serde passes the store's key) is bound to it: read under another
key, a valid chunk is an error, not another chunk's tensor (a mix-up no checksum sees). The digest is 32
bits: it catches mix-ups, it is not a defence against someone forging chunks.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvcx.codecs.backends import is_tensor
from kvcx.codecs.base import Packed
from kvcx.codecs.gpu import dtype_name_of, to_device, to_host
from kvcx.codecs.dtypes import DTYPE_NAMES, dtype_name, is_int, numpy_dtype
from kvcx.codecs.intcodec import IntCodec
from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.runtime import crc32c, crc32c_blocks
from kvcx.errors import CodecError, FormatError, KvcxError

MAGIC = b"KVCX"
WIRE_VERSION = 2
READABLE_WIRE_VERSIONS = (1, 2)
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHHBBHIIII" + "BBBBHHI" * 2 + "III")
assert _HEADER.size == HEADER_BYTES
_CRC_OFFSET = 52
_DT_BY_CODE = {code: name for name, code in DTYPE_NAMES.items()}
_AXES = {"token": 0, "channel": 1}
_AXIS_NAMES = {v: k for k, v in _AXES.items()}
MAX_DIM = 2 ** 31 - 1
CRC_BLOCK = 1 << 16


def checksum(buf: np.ndarray, n_threads: Optional[int] = None) -> int:
    """The chunk checksum of a serialized buffer (header field excluded); see the module docstring."""
    blocks = crc32c_blocks(buf[HEADER_BYTES:], CRC_BLOCK, n_threads)
    crc = crc32c(buf[:_CRC_OFFSET])
    crc = crc32c(buf[_CRC_OFFSET + 4:HEADER_BYTES], crc)
    return crc32c(blocks.view(np.uint8), crc)


def key_digest(key: Optional[bytes]) -> int:
    """The header's key digest for a store key (bytes): CRC-32C with the low bit set; 0 without a key."""
    if key is None:
        return 0
    return crc32c(np.frombuffer(bytes(key), dtype=np.uint8)) | 1


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class _Sections:
    """Where each section of one kind (keys or values) lives, and the codec that sees the tensor as ``view``."""

    view: tuple          # the shape the codec sees
    codec: IntCodec      # the kind's codec (with the sinks of this view)
    codes: tuple         # (offset, nbytes)
    scales: tuple        # (offset, nbytes, shape)
    zeros: Optional[tuple]
    sinks: Optional[tuple]
    end: int

    def record(self, buf: np.ndarray, dtype: np.dtype) -> Packed:
        """The kind's Packed record as views of ``buf``'s sections (what encode writes, what decode reads)."""
        def section(sec, dt, shape):
            return buf[sec[0]:sec[0] + sec[1]].view(dt).reshape(shape)

        return Packed(codes=buf[self.codes[0]:self.codes[0] + self.codes[1]],
                      scales=section(self.scales, np.float16, self.scales[2]),
                      zeros=section(self.zeros, np.float16, self.zeros[2]) if self.zeros else None,
                      sinks=section(self.sinks, dtype, self.sinks[2]) if self.sinks else None,
                      shape=self.view, dtype=dtype_name(dtype), config=self.codec.packed_config(self.view))


class ChunkCodec:
    """Packs ``[2, L, T, H * D]`` KV chunks with a kvcx :class:`KVConfig` (default: the ``kvcx`` scheme).

    ``head_dim`` splits the last axis into heads. The chunk's geometry is checked here; each kind is
    encoded and decoded by its codec, straight from and into the buffer's sections.
    """

    def __init__(self, config: Optional[KVConfig] = None, head_dim: int = 64):
        if not is_int(head_dim) or not 1 <= head_dim <= 65535:
            raise CodecError(f"head_dim must be an integer from 1 to 65535, got {head_dim!r}")
        self.config = config or KVConfig.from_scheme()
        if self.config.layer_bits:
            raise CodecError("a KV chunk holds every layer in one code stream with one width for keys and one for "
                             "values; per-layer widths (a --plan / layer_bits) are not supported here: use a scheme")
        if not (isinstance(self.config.key, IntCodec) and isinstance(self.config.value, IntCodec)):
            raise CodecError(f"the LMCache chunk format holds fixed-width codes; scheme {self.config.scheme!r} "
                             "(per-channel key widths) is not supported here: use kvcx, kvcx3 or kvcx2")
        self.head_dim = head_dim
        self._sections_cache: dict = {}
        self._stored_cache: dict = {}
        for kind, c in (("key", self.config.key), ("value", self.config.value)):
            if c.rotate and c.axis == "channel":
                raise CodecError(f"the {kind} codec rotates and also uses per-channel groups; in a KV chunk a "
                                 "rotation is applied per head, which per-channel groups cannot share: drop one of them")
            if c.rotate and (head_dim < 8 or head_dim & (head_dim - 1)):
                raise CodecError(f"the {kind} codec rotates, which needs head_dim to be a power of two >= 8, "
                                 f"got {head_dim}")

    # -- geometry ---------------------------------------------------------------
    def _check_shape(self, shape, where: str) -> tuple:
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4 or shape[0] != 2:
            raise CodecError(f"{where}: a KV chunk has shape [2, layers, tokens, kv_heads * head_dim] "
                             f"(LMCache's KV_2LTD), got {list(shape)}")
        _, L, T, HD = shape
        if min(L, T, HD) < 1 or max(L, T, HD) > MAX_DIM:
            raise CodecError(f"{where}: chunk shape {list(shape)} has an empty or oversized dimension")
        if HD % self.head_dim:
            raise CodecError(f"{where}: the last dim {HD} is not a multiple of head_dim {self.head_dim}; "
                             "set head_dim to the model's head size")
        return shape

    def _sections(self, codec: IntCodec, L: int, T: int, HD: int, itemsize: int, start: int) -> _Sections:
        # a rotation works per head: each layer as (tokens * heads) rows of head_dim, whose first
        # sinks * heads rows are the sink tokens
        H = HD // self.head_dim
        view = (L, T * H, self.head_dim) if codec.rotate else (L, T, HD)
        if codec.rotate and codec.sinks:
            codec = IntCodec.from_config({**codec.get_config(), "sinks": min(codec.sinks, T) * H,
                                          "n_threads": codec.n_threads, "backend": codec.backend})
        lay = codec.layout(view, "chunk")
        off = start
        codes = (off, lay.codes_nbytes)
        off = _pad8(off + lay.codes_nbytes)
        nscale = int(np.prod(lay.scale_shape))
        scales = (off, 2 * nscale, lay.scale_shape)
        off = _pad8(off + 2 * nscale)
        zeros = None
        if codec.has_zeros:
            zeros = (off, 2 * nscale, lay.scale_shape)
            off = _pad8(off + 2 * nscale)
        sinks = None
        if lay.t0:
            n = L * lay.t0 * view[2] * itemsize
            sinks = (off, n, (L, lay.t0, view[2]))
            off = _pad8(off + n)
        return _Sections(view=view, codec=codec, codes=codes, scales=scales, zeros=zeros, sinks=sinks, end=off)

    def _stored(self, hdr: dict) -> "ChunkCodec":
        """A codec with the settings a chunk header records, on this codec's threads (one per distinct
        settings; their sections cached)."""
        k = (tuple(sorted(hdr["key"].get_config().items())), tuple(sorted(hdr["value"].get_config().items())),
             hdr["head_dim"])
        if k not in self._stored_cache:
            if len(self._stored_cache) > 16:
                self._stored_cache.clear()
            n, b = self.config.value.n_threads, self.config.value.backend
            self._stored_cache[k] = ChunkCodec(KVConfig(key=hdr["key"].with_threads(n).with_backend(b),
                                                        value=hdr["value"].with_threads(n).with_backend(b),
                                                        scheme="stored"), hdr["head_dim"])
        return self._stored_cache[k]

    def _kinds(self, shape, itemsize: int):
        """Both kinds' sections for a chunk shape (computed once per shape and dtype size)."""
        k = (tuple(shape), itemsize)
        if k not in self._sections_cache:
            _, L, T, HD = shape
            ks = self._sections(self.config.key, L, T, HD, itemsize, HEADER_BYTES)
            vs = self._sections(self.config.value, L, T, HD, itemsize, ks.end)
            if len(self._sections_cache) > 64:
                self._sections_cache.clear()
            self._sections_cache[k] = (ks, vs)
        return self._sections_cache[k]

    def serialized_size(self, shape, dtype) -> int:
        """Exact bytes of a serialized chunk of this shape and dtype."""
        shape = self._check_shape(shape, "chunk")
        name = dtype_name(np.dtype(dtype))
        if name is None:
            raise CodecError(f"chunk dtype {dtype} is not bfloat16, float16 or float32")
        return self._kinds(shape, numpy_dtype(name).itemsize)[1].end

    # -- encode -------------------------------------------------------------------
    def encode_into(self, chunk, out: np.ndarray, where: str = "chunk", key: Optional[bytes] = None) -> int:
        """Serialize ``chunk`` into the uint8 buffer ``out``; returns the bytes written. ``key``: the store key it
        is written under (bytes), which reading it under another key then refuses. ``chunk``: a NumPy array, or
        a torch tensor, encoded where its codecs' backend works (a CUDA chunk on the GPU: only the packed
        sections travel to ``out``, with the bytes the CPU kernels would write)."""
        on_device = is_tensor(chunk)
        name = dtype_name_of(chunk) if on_device else dtype_name(chunk.dtype)
        if name is None:
            raise CodecError(f"{where}: dtype {chunk.dtype} is not bfloat16, float16 or float32")
        shape = self._check_shape(chunk.shape, where)
        if not (chunk.is_contiguous() if on_device else chunk.flags.c_contiguous):
            raise CodecError(f"{where}: the chunk must be C-contiguous")
        dtype = numpy_dtype(name)
        ks, vs = self._kinds(shape, dtype.itemsize)
        total = vs.end
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable \
                or out.size < total:
            raise CodecError(f"{where}: the destination must be a writeable byte buffer of at least {total} bytes, "
                             f"got {out.dtype} {list(out.shape)}")
        buf = out[:total]
        for sec, x in ((ks, chunk[0]), (vs, chunk[1])):
            # the codec straight into the buffer's sections: every size was checked when they were laid out
            if on_device:
                _copy_record(to_host(sec.codec.encode(x.reshape(sec.view), name=where)), sec.record(buf, dtype))
            else:
                sec.codec.encode(x.reshape(sec.view), out=sec.record(buf, dtype), name=where)
            for part in (sec.codes, sec.scales, sec.zeros, sec.sinks):  # the padding too: the same chunk
                if part:                                                 # gives the same bytes in any buffer
                    buf[part[0] + part[1]:_pad8(part[0] + part[1])] = 0
        _, L, T, HD = shape
        header = _HEADER.pack(MAGIC, WIRE_VERSION, HEADER_BYTES, DTYPE_NAMES[name], 0, 0, L, T, HD // self.head_dim,
                              self.head_dim, *self._codec_fields(self.config.key),
                              *self._codec_fields(self.config.value), 0, total - HEADER_BYTES, key_digest(key))
        buf[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
        crc = checksum(buf, self.config.value.n_threads)
        buf[_CRC_OFFSET:_CRC_OFFSET + 4] = np.frombuffer(struct.pack("<I", crc), dtype=np.uint8)
        return total

    @staticmethod
    def _codec_fields(c: IntCodec) -> tuple:
        return (c.bits, int(c.asym), _AXES[c.axis], int(c.rotate), c.group_size, 0, c.sinks)

    # -- decode -------------------------------------------------------------------
    def decode_into(self, data: np.ndarray, out, where: str = "chunk", key: Optional[bytes] = None) -> None:
        """Decode a serialized chunk into ``out`` (the chunk's shape and dtype). Anything that is not a
        chunk this codec's format describes exactly (foreign bytes, a damaged buffer, another shape or
        dtype, a chunk bound to another ``key``) raises :class:`FormatError`; ``out`` is then not fully
        written. ``out`` may be a torch tensor: the packed sections go to its device and are decoded there."""
        hdr = read_header(data, where)
        on_device = is_tensor(out)
        name = dtype_name_of(out) if on_device else dtype_name(out.dtype)
        if name is None or not (out.is_contiguous() if on_device else out.flags.c_contiguous and out.flags.writeable):
            raise CodecError(f"{where}: the destination must be a writeable C-contiguous bfloat16/float16/float32 "
                             f"array, got {out.dtype}")
        dtype = numpy_dtype(name)
        shape = (2, hdr["layers"], hdr["tokens"], hdr["kv_heads"] * hdr["head_dim"])
        if tuple(out.shape) != shape or hdr["dtype"] != name:
            raise FormatError(f"{where}: the stored chunk is {hdr['dtype']} {list(shape)}, the destination is "
                              f"{name} {list(out.shape)}; it was written for another model or layout")
        try:
            ks, vs = self._stored(hdr)._kinds(shape, dtype.itemsize)
        except CodecError as exc:
            raise FormatError(f"{where}: the chunk header describes settings kvcx cannot decode ({exc})") from None
        if vs.end - HEADER_BYTES != hdr["payload"] or data.size < vs.end:
            raise FormatError(f"{where}: the payload is {hdr['payload']} bytes in a {data.size}-byte buffer; a chunk "
                              f"of this shape and these settings has {vs.end - HEADER_BYTES}: it is damaged")
        body = data[:vs.end]
        if checksum(body, self.config.value.n_threads) != hdr["crc32"]:
            raise FormatError(f"{where}: the chunk fails its CRC-32C check; the stored bytes are damaged")
        if key is not None and hdr["key_digest"] and hdr["key_digest"] != key_digest(key):
            raise FormatError(f"{where}: the chunk was written under another key (a valid chunk in the wrong place); "
                              "it is not this key's data")
        for sec, dst in ((ks, out[0]), (vs, out[1])):
            packed = sec.record(body, dtype)
            for part in (packed.scales, packed.zeros):
                if part is not None and not np.isfinite(part).all():
                    raise FormatError(f"{where}: the chunk holds non-finite scales; it is damaged")
            if on_device:
                packed = to_device(packed, out.device)
            try:   # the codec refuses every parameter an encoder could not have written
                sec.codec.decode(packed, out=dst.reshape(sec.view), name=where)
            except CodecError as exc:
                raise FormatError(f"{where}: the chunk is damaged ({exc})") from None


def _copy_record(src: Packed, dst: Packed) -> None:
    """A record's arrays into another's buffers of the same sizes (a device-encoded record into its sections)."""
    for a, b in ((src.codes, dst.codes), (src.scales, dst.scales), (src.zeros, dst.zeros), (src.sinks, dst.sinks)):
        if b is not None:
            b.reshape(-1).view(np.uint8)[...] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def read_header(data: np.ndarray, where: str = "chunk") -> dict:
    """The checked header of a serialized chunk (FormatError for anything else)."""
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise FormatError(f"{where}: a serialized chunk is a 1-D byte buffer")
    if data.size < HEADER_BYTES:
        raise FormatError(f"{where}: {data.size} bytes are too few for a kvcx chunk (the header alone is "
                          f"{HEADER_BYTES}); it is not a kvcx chunk or it is truncated")
    f = _HEADER.unpack(data[:HEADER_BYTES].tobytes())
    magic, version, hbytes, dt, flags, res0, L, T, H, D = f[:10]
    kf, vf = f[10:17], f[17:24]
    crc, payload, digest = f[24:]
    if magic != MAGIC:
        raise FormatError(f"{where}: not a kvcx chunk (magic {magic!r}, expected {MAGIC!r}); the store holds "
                          "another serde's data: use the serde that wrote it")
    if version not in READABLE_WIRE_VERSIONS or hbytes != HEADER_BYTES:
        raise FormatError(f"{where}: kvcx chunk wire version {version} (header {hbytes} bytes) is not supported by "
                          f"this kvcx (versions {', '.join(map(str, READABLE_WIRE_VERSIONS))}); upgrade kvcx")
    if dt not in _DT_BY_CODE or flags or res0 or min(L, T, H, D) < 1 or (version == 1 and digest) \
            or (digest and not digest & 1):
        raise FormatError(f"{where}: the kvcx chunk header is damaged")

    def codec(fields, kind):
        bits, asym, axis, rotate, group, res, sinks = fields
        if asym > 1 or axis not in _AXIS_NAMES or rotate > 1 or res:
            raise FormatError(f"{where}: the {kind} codec in the chunk header is damaged")
        try:
            return IntCodec(group_size=group, scheme="asymmetric" if asym else "symmetric", bits=bits,
                            axis=_AXIS_NAMES[axis], rotate=bool(rotate), sinks=sinks)
        except KvcxError as exc:
            raise FormatError(f"{where}: the {kind} codec in the chunk header is damaged ({exc})") from None

    return {"dtype": _DT_BY_CODE[dt], "layers": L, "tokens": T, "kv_heads": H, "head_dim": D,
            "key": codec(kf, "key"), "value": codec(vf, "value"), "crc32": crc, "payload": payload,
            "version": version, "key_digest": digest}
