"""The LMCache chunk wire format on its own: CRC-32C, exact sizes, dtypes and schemes, settings carried."""

import struct

import numpy as np
import pytest

from kvcx.codecs import KVConfig
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import CodecError, FormatError
from kvcx.formats.chunk import ChunkCodec, read_header

from helpers import codec_roundtrip, plan_config, reseal, small_chunk


def test_crc32c_known_values():
    from kvcx.codecs.cpu import core as _core

    assert _core.crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283  # the standard check value
    assert _core.crc32c(np.zeros(32, np.uint8)) == 0x8A9136AA  # RFC 3720 B.4
    data = np.random.default_rng(0).integers(0, 256, 1001, dtype=np.uint8)
    assert _core.crc32c(data[500:], _core.crc32c(data[:500])) == _core.crc32c(data)
    blocks = np.empty(4, np.uint32)
    _core.crc32c_blocks(data, 256, blocks, 2)
    assert blocks.tolist() == [_core.crc32c(data[i:i + 256]) for i in range(0, 1001, 256)]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, BFLOAT16])
@pytest.mark.parametrize("scheme", ["kvcx", "reference", "kivi"])
def test_dtypes_schemes_and_exact_sizes(dtype, scheme):
    x = small_chunk(3).astype(dtype)
    codec = ChunkCodec(KVConfig.from_scheme(scheme), head_dim=64)
    buf, y = codec_roundtrip(codec, x)
    h = read_header(buf)
    assert (h["dtype"], h["layers"], h["tokens"], h["kv_heads"], h["head_dim"]) == \
        ({np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", BFLOAT16: "BF16"}[np.dtype(dtype)], 3, 64, 2, 64)
    assert y.dtype == x.dtype and np.isfinite(y.astype(np.float32)).all()
    rel = np.sqrt(((y.astype(np.float32) - x.astype(np.float32)) ** 2).mean() / (x.astype(np.float32) ** 2).mean())
    assert rel < 0.2, rel
    # the same chunk gives the same bytes in any buffer (section padding written too)
    dirty = np.full(buf.size, 0xA5, np.uint8)
    codec.encode_into(x, dirty)
    assert np.array_equal(dirty, buf)
    if scheme == "kvcx":  # keys and (rotated) values keep every head's first token exact
        assert np.array_equal(y[:, :, 0, :].view(np.uint8), x[:, :, 0, :].view(np.uint8))
        assert not np.array_equal(y[:, :, 1, :].view(np.uint8), x[:, :, 1, :].view(np.uint8))
    # the settings travel with the chunk: a reader configured otherwise still decodes it right
    z = np.empty_like(x)
    ChunkCodec(KVConfig.from_scheme("asymmetric"), head_dim=128).decode_into(buf, z)
    assert np.array_equal(z.view(np.uint8), y.view(np.uint8))


def test_kv_chunks_refuse_per_layer_widths():
    from kvcx.formats.chunk import ChunkCodec

    with pytest.raises(CodecError, match="per-layer widths"):
        ChunkCodec(plan_config())


def test_a_chunk_is_bound_to_its_store_key():
    """A valid chunk read under another key is an error (a mix-up in the store that no checksum sees); chunks of
    wire version 1, written without a key, still read under any key."""
    from kvcx.formats.chunk import key_digest

    x = small_chunk(7)
    codec = ChunkCodec()
    buf = np.empty(codec.serialized_size(x.shape, x.dtype), np.uint8)
    codec.encode_into(x, buf, key=b"model@0@chunk-a")
    h = read_header(buf)
    assert h["version"] == 2 and h["key_digest"] == key_digest(b"model@0@chunk-a") and h["key_digest"] & 1
    out = np.empty_like(x)
    codec.decode_into(buf, out, key=b"model@0@chunk-a")
    codec.decode_into(buf, out)   # a reader that has no key
    with pytest.raises(FormatError, match="written under another key"):
        codec.decode_into(buf, out, key=b"model@0@chunk-b")
    # without a key: digest 0, read under any key; as wire version 1 (digest 0 there), too
    plain = np.empty_like(buf)
    codec.encode_into(x, plain)
    assert read_header(plain)["key_digest"] == 0
    codec.decode_into(plain, out, key=b"anything")
    v1 = plain.copy()
    v1[4:6] = np.frombuffer(struct.pack("<H", 1), np.uint8)
    codec.decode_into(reseal(v1), out, key=b"anything")
    np.testing.assert_array_equal(out.view(np.uint16), codec_roundtrip(codec, x)[1].view(np.uint16))
    # a version-1 header with a digest, or an even digest: damaged
    for version, digest in ((1, 5), (2, 4)):
        b = buf.copy()
        b[4:6] = np.frombuffer(struct.pack("<H", version), np.uint8)
        b[60:64] = np.frombuffer(struct.pack("<I", digest), np.uint8)
        with pytest.raises(FormatError, match="header is damaged"):
            codec.decode_into(reseal(b), out)
