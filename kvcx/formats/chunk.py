"""A KV chunk as one self-describing byte string: the wire format of the LMCache serde.

A chunk is one tensor in one of the layouts engines hand LMCache (:mod:`kvcx.formats.layouts`): LMCache's
``KV_2LTD`` ``[2, layers, tokens, kv_heads * head_dim]`` (keys at index 0, values at 1), vLLM's CPU fused
K/V plane ``[layers, tokens, kv_heads * 2 * head_dim]`` or an MLA latent plane ``[layers, tokens, latent]``;
BF16, FP16 or FP32. :class:`ChunkCodec` packs it into a buffer whose size is known exactly from the shape,
dtype and settings (:meth:`ChunkCodec.serialized_size`). A KV_2LTD or MLA chunk is encoded straight from the
chunk's memory into the destination buffer and decoded straight into a chunk; a fused plane's keys and
values are first gathered into planes of their own (one copy each way), so that the key codec sees keys
and the value codec values.

Byte layout (all integers little-endian; every section starts on an 8-byte boundary)::

    0   magic  b"KVCX"          4   u16 wire version (2 for KV_2LTD, 3 for the other layouts)
    6   u16 header bytes (64)
    8   u8 dtype (0 F32, 1 F16, 2 BF16)
    9   u8 layout (0 KV_2LTD, 1 vLLM CPU fused in the vec order, 2 vLLM CPU fused in the amx order, 3 MLA)
    10  u16 the engine's block size (fused layouts; 0 otherwise)
    12  u32 layers   16 u32 tokens   20 u32 kv_heads   24 u32 head_dim   (MLA: kv_heads 1, head_dim the latent)
    28  key codec:   u8 bits, u8 asymmetric, u8 axis (0 token, 1 channel), u8 rotate,
                     u16 group_size, u16 reserved (0), u32 sinks
    40  value codec: the same 12 bytes (all 0 for MLA, which has no value plane)
    52  u32 checksum: CRC-32C (Castagnoli) over header bytes 0..51 and 56..63, then the little-endian
        u32 CRC-32C of each 64 KiB block of the payload in order (blocks are checked in parallel)
    56  u32 payload bytes (after the header)
    60  u32 key digest: CRC-32C of the store key the chunk was written under, with its low bit set;
        0 when the writer gave no key (wire version 1 has 0 here: its chunks are read, unbound)
    64  key sections: codes, scales, zeros (asymmetric), sinks (sinks > 0), each padded to 8
        value sections: the same (none for MLA)

A chunk is decoded only into the layout it was written from: the header's layout, ISA order and block size
must be the ones the reader's configuration gives the destination, or the read is refused. Wire version 2
readers refuse version 3 chunks, so an older kvcx never mistakes a fused plane for KV_2LTD.

Each plane (keys, values; MLA's latent, with the key codec) is seen as ``(layers, tokens, kv_heads *
head_dim)``: per-channel groups run along tokens for every (head, dim) channel, and sink tokens are the chunk's
first tokens, exactly as ``kvcx compress`` does on ``[1, kv_heads, tokens, head_dim]`` tensors. A codec that
rotates is applied per head, each layer seen as ``(tokens * kv_heads, head_dim)`` rows (its sink tokens are then
the first ``sinks * kv_heads`` rows, the same bytes); it cannot use per-channel groups. Token-axis groups of at
most ``head_dim`` values that divide it are the same groups as in a file; the default scheme decodes bit for bit
as ``kvcx compress`` does.

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
from kvcx.formats.layouts import KV_2LTD, ChunkLayout, Geometry, layout_for_shape, layout_from_wire

MAGIC = b"KVCX"
WIRE_VERSION = 3           # written for the single-plane layouts; KV_2LTD chunks are written as version 2
KV_2LTD_WIRE_VERSION = 2   # (so that a kvcx that knows only KV_2LTD still reads them)
READABLE_WIRE_VERSIONS = (1, 2, 3)
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
    """Packs KV chunks with a kvcx :class:`KVConfig` (default: the ``kvcx`` scheme).

    ``head_dim`` splits the last axis into heads. ``plane_layout`` is the layout of 3-D chunks (a
    :class:`~kvcx.formats.layouts.ChunkLayout`: vLLM's CPU fused plane or MLA's latent plane; None refuses
    them); 4-D chunks are KV_2LTD. The chunk's geometry is checked here; each plane is encoded and decoded by
    its kind's codec, straight from and into the buffer's sections.
    """

    def __init__(self, config: Optional[KVConfig] = None, head_dim: int = 64,
                 plane_layout: Optional[ChunkLayout] = None):
        if not is_int(head_dim) or not 1 <= head_dim <= 65535:
            raise CodecError(f"head_dim must be an integer from 1 to 65535, got {head_dim!r}")
        if plane_layout is not None and (not isinstance(plane_layout, ChunkLayout) or plane_layout == KV_2LTD):
            raise CodecError(f"plane_layout must be a single-plane chunk layout (kvcx.formats.layouts), "
                             f"got {plane_layout!r}")
        self.config = config or KVConfig.from_scheme()
        if self.config.key_rope is not None:
            raise CodecError("a KV chunk's keys are the engine's, after RoPE, at positions the chunk does not record; "
                             "keys coded before RoPE (key_rope) are for packed files and the gate: use the config "
                             "without key_rope")
        if self.config.layer_bits:
            raise CodecError("a KV chunk holds every layer in one code stream with one width for keys and one for "
                             "values; per-layer widths (a --plan / layer_bits) are not supported here: use a scheme")
        if not (isinstance(self.config.key, IntCodec) and isinstance(self.config.value, IntCodec)):
            raise CodecError(f"the LMCache chunk format holds fixed-width codes; scheme {self.config.scheme!r} "
                             "(per-channel key widths) is not supported here: use kvcx, kvcx3 or kvcx2")
        self.head_dim = head_dim
        self.plane_layout = plane_layout
        self._sections_cache: dict = {}
        self._stored_cache: dict = {}
        for kind, c in (("key", self.config.key), ("value", self.config.value)):
            if c.rotate and c.axis == "channel":
                raise CodecError(f"the {kind} codec rotates and also uses per-channel groups; in a KV chunk a "
                                 "rotation is applied per head, which per-channel groups cannot share: drop one of "
                                 "them")
            if c.rotate and (head_dim < 8 or head_dim & (head_dim - 1)):
                raise CodecError(f"the {kind} codec rotates, which needs head_dim to be a power of two >= 8, "
                                 f"got {head_dim}")

    # -- geometry ---------------------------------------------------------------
    def geometry(self, shape, dtype_name_: str, where: str = "chunk") -> Geometry:
        """What a chunk of ``shape`` holds, in which layout (its ISA order fixed for the dtype), or CodecError."""
        lay = layout_for_shape(shape, self.plane_layout, where)
        if hasattr(lay, "resolve"):
            lay = lay.resolve(dtype_name_, self.head_dim)
        g = lay.geometry(shape, self.head_dim, where)
        codecs = (self.config.key, self.config.value)[:g.planes]
        for kind, c in zip(("key", "value"), codecs):
            if c.rotate and (g.head_dim < 8 or g.head_dim & (g.head_dim - 1)):
                raise CodecError(f"{where}: the {kind} codec rotates, which needs each head's width to be a power "
                                 f"of two >= 8; a {lay.describe()} chunk's is {g.head_dim}: use a scheme that "
                                 "does not rotate")
        return g

    def _sections(self, codec: IntCodec, g: Geometry, itemsize: int, start: int) -> _Sections:
        # a rotation works per head: each layer as (tokens * heads) rows of head_dim, whose first
        # sinks * heads rows are the sink tokens
        L, T, H, D = g.layers, g.tokens, g.heads, g.head_dim
        view = (L, T * H, D) if codec.rotate else (L, T, H * D)
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
        value = hdr["value"] or hdr["key"]      # MLA: no value plane (its codec never runs)
        k = (tuple(sorted(hdr["key"].get_config().items())), tuple(sorted(value.get_config().items())),
             hdr["head_dim"])
        if k not in self._stored_cache:
            if len(self._stored_cache) > 16:
                self._stored_cache.clear()
            n, b = self.config.value.n_threads, self.config.value.backend
            self._stored_cache[k] = ChunkCodec(KVConfig(key=hdr["key"].with_threads(n).with_backend(b),
                                                        value=value.with_threads(n).with_backend(b),
                                                        scheme="stored"), hdr["head_dim"])
        return self._stored_cache[k]

    def _kinds(self, g: Geometry, itemsize: int) -> tuple:
        """Each plane's sections for a geometry (computed once per geometry and dtype size)."""
        k = (g, itemsize)
        if k not in self._sections_cache:
            secs, start = [], HEADER_BYTES
            for codec in (self.config.key, self.config.value)[:g.planes]:
                secs.append(self._sections(codec, g, itemsize, start))
                start = secs[-1].end
            if len(self._sections_cache) > 64:
                self._sections_cache.clear()
            self._sections_cache[k] = tuple(secs)
        return self._sections_cache[k]

    def serialized_size(self, shape, dtype) -> int:
        """Exact bytes of a serialized chunk of this shape and dtype."""
        name = dtype_name(np.dtype(dtype)) if dtype is not None else None
        if name is None:
            raise CodecError(f"chunk dtype {dtype} is not bfloat16, float16 or float32")
        g = self.geometry(shape, name)
        return self._kinds(g, numpy_dtype(name).itemsize)[-1].end

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
        g = self.geometry(chunk.shape, name, where)
        if not (chunk.is_contiguous() if on_device else chunk.flags.c_contiguous):
            raise CodecError(f"{where}: the chunk must be C-contiguous")
        if on_device and g.layout.planes == 2 and g.layout != KV_2LTD:
            raise CodecError(f"{where}: a {g.layout.describe()} chunk is a CPU layout; move it to the CPU first")
        dtype = numpy_dtype(name)
        kinds = self._kinds(g, dtype.itemsize)
        total = kinds[-1].end
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable \
                or out.size < total:
            raise CodecError(f"{where}: the destination must be a writeable byte buffer of at least {total} bytes, "
                             f"got {out.dtype} {list(out.shape)}")
        buf = out[:total]
        for sec, x in zip(kinds, g.layout.split(chunk, g, self.config.value.n_threads)):
            # the codec straight into the buffer's sections: every size was checked when they were laid out
            if on_device:
                _copy_record(to_host(sec.codec.encode(x.reshape(sec.view), name=where)), sec.record(buf, dtype))
            else:
                sec.codec.encode(x.reshape(sec.view), out=sec.record(buf, dtype), name=where)
            for part in (sec.codes, sec.scales, sec.zeros, sec.sinks):  # the padding too: the same chunk
                if part:                                                 # gives the same bytes in any buffer
                    buf[part[0] + part[1]:_pad8(part[0] + part[1])] = 0
        value_fields = self._codec_fields(self.config.value) if g.planes == 2 else (0,) * 7
        version = KV_2LTD_WIRE_VERSION if g.layout == KV_2LTD else WIRE_VERSION
        header = _HEADER.pack(MAGIC, version, HEADER_BYTES, DTYPE_NAMES[name], g.layout.code,
                              g.layout.block_size, g.layers, g.tokens, g.heads, g.head_dim,
                              *self._codec_fields(self.config.key), *value_fields, 0, total - HEADER_BYTES,
                              key_digest(key))
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
        chunk this codec's format describes exactly (foreign bytes, a damaged buffer, another shape, dtype or
        layout, a chunk bound to another ``key``) raises :class:`FormatError`; ``out`` is then not fully
        written. ``out`` may be a torch tensor: the packed sections go to its device and are decoded there."""
        hdr = read_header(data, where)
        on_device = is_tensor(out)
        name = dtype_name_of(out) if on_device else dtype_name(out.dtype)
        if name is None or not (out.is_contiguous() if on_device else out.flags.c_contiguous and out.flags.writeable):
            raise CodecError(f"{where}: the destination must be a writeable C-contiguous bfloat16/float16/float32 "
                             f"array, got {out.dtype}")
        dtype = numpy_dtype(name)
        want = layout_for_shape(out.shape, self.plane_layout, where)   # the layout this reader gives `out`
        if hasattr(want, "resolve"):
            want = want.resolve(name, hdr["head_dim"])
        stored = hdr["layout"]
        if stored != want:
            raise FormatError(f"{where}: the stored chunk is a {stored.describe()} chunk; this serde reads "
                              f"{want.describe()} chunks into this destination: a chunk never decodes "
                              "into another layout (check the serde's layout, block_size and isa options)")
        g = Geometry(stored, stored.planes, hdr["layers"], hdr["tokens"], hdr["kv_heads"], hdr["head_dim"])
        shape = stored.chunk_shape(g)
        if tuple(out.shape) != shape or hdr["dtype"] != name:
            raise FormatError(f"{where}: the stored chunk is {hdr['dtype']} {list(shape)}, the destination is "
                              f"{name} {list(out.shape)}; it was written for another model or layout")
        if on_device and stored.planes == 2 and stored != KV_2LTD:
            raise CodecError(f"{where}: a {stored.describe()} chunk is a CPU layout; decode it into a CPU array")
        try:
            kinds = self._stored(hdr)._kinds(g, dtype.itemsize)
        except CodecError as exc:
            raise FormatError(f"{where}: the chunk header describes settings kvcx cannot decode ({exc})") from None
        end = kinds[-1].end
        if end - HEADER_BYTES != hdr["payload"] or data.size < end:
            raise FormatError(f"{where}: the payload is {hdr['payload']} bytes in a {data.size}-byte buffer; a chunk "
                              f"of this shape and these settings has {end - HEADER_BYTES}: it is damaged")
        body = data[:end]
        if checksum(body, self.config.value.n_threads) != hdr["crc32"]:
            raise FormatError(f"{where}: the chunk fails its CRC-32C check; the stored bytes are damaged")
        if key is not None and hdr["key_digest"] and hdr["key_digest"] != key_digest(key):
            raise FormatError(f"{where}: the chunk was written under another key (a valid chunk in the wrong place); "
                              "it is not this key's data")
        planes = stored.scratch(out, g)
        for sec, dst in zip(kinds, planes):
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
        stored.join(planes, out, g, self.config.value.n_threads)


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
    if dt not in _DT_BY_CODE or min(L, T, H, D) < 1 or (version == 1 and digest) or (digest and not digest & 1):
        raise FormatError(f"{where}: the kvcx chunk header is damaged")
    layout = layout_from_wire(flags, res0)
    if version < 3 and (flags or res0):       # versions 1 and 2 hold KV_2LTD chunks only (zeros there)
        raise FormatError(f"{where}: the kvcx chunk header is damaged")
    if layout is None or (version == 3 and layout == KV_2LTD):
        raise FormatError(f"{where}: the kvcx chunk header names layout {flags} with block size {res0}, which this "
                          "kvcx does not know: it is damaged, or written by a newer kvcx (upgrade kvcx)")
    if layout.planes == 1 and (H != 1 or any(vf)):
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

    return {"dtype": _DT_BY_CODE[dt], "layers": L, "tokens": T, "kv_heads": H, "head_dim": D, "layout": layout,
            "key": codec(kf, "key"), "value": codec(vf, "value") if layout.planes == 2 else None, "crc32": crc,
            "payload": payload, "version": version, "key_digest": digest}
