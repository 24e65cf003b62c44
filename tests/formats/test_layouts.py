"""Chunk layouts (kvcx.formats.layouts) and the wire format's record of them: every layout finds the keys and
values where its engine put them, a fused chunk is encoded exactly as its KV_2LTD twin, and a chunk is only
ever decoded into the layout it was written from."""
import struct

import numpy as np
import pytest

from kvcx.codecs import KVConfig
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import CodecError, FormatError
from kvcx.formats.chunk import ChunkCodec, read_header
from kvcx.formats.layouts import KV_2LTD, MLA, VllmCpu, layout_from_wire, plane_layout

from helpers import codec_roundtrip, reseal


def _kv(L=3, T=256, H=3, D=64, seed=0, dtype=BFLOAT16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, L, T, H * D)) * 2 + rng.standard_normal(H * D) * 3).astype(dtype)


def _reference_fused(kv, bs, isa, D):
    """The fused plane written element by element from the orders in the layouts module's table."""
    _, L, T, HD = kv.shape
    H = HD // D
    out = np.zeros((L, T, 2 * HD), kv.dtype)
    t, d = np.meshgrid(np.arange(bs), np.arange(D), indexing="ij")
    if isa == "amx":
        pk = ((t // 16) * (D // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
        pv = ((d // 16) * (bs // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        pk, pv = d * bs + t, t * D + d
    slab = np.zeros(2 * bs * D, kv.dtype)
    for b in range(T // bs):
        for h in range(H):
            for layer in range(L):
                slab[pk] = kv[0, layer, b * bs:(b + 1) * bs, h * D:(h + 1) * D]
                slab[bs * D + pv] = kv[1, layer, b * bs:(b + 1) * bs, h * D:(h + 1) * D]
                out[layer, b * bs:(b + 1) * bs, h * 2 * D:(h + 1) * 2 * D] = slab.reshape(bs, 2 * D)
    return out


@pytest.mark.parametrize("isa,bs,D", [("vec", 128, 64), ("vec", 32, 64), ("vec", 64, 128), ("vec16", 16, 80),
                                      ("amx", 32, 64), ("amx", 128, 128), ("amx", 64, 32)])
@pytest.mark.parametrize("dtype", [BFLOAT16, np.float16, np.float32])
def test_fused_planes_are_found_where_the_table_puts_them(isa, bs, D, dtype):
    kv = _kv(L=2, T=2 * bs, H=2, D=D, dtype=dtype)
    lay = VllmCpu(bs, isa)
    fused = _reference_fused(kv, bs, isa, D)
    g = lay.geometry(fused.shape, D, "chunk")
    assert (g.planes, g.layers, g.tokens, g.heads, g.head_dim) == (2, 2, kv.shape[2], 2, D)
    k, v = lay.split(fused, g)
    assert np.array_equal(k.view(np.uint8), kv[0].view(np.uint8)) and np.array_equal(v.view(np.uint8),
                                                                                       kv[1].view(np.uint8))
    back = np.zeros_like(fused)
    lay.join([k, v], back, g)
    assert np.array_equal(back.view(np.uint8), fused.view(np.uint8))


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_a_fused_chunk_is_encoded_as_its_kv_2ltd_twin(isa):
    """The key codec sees the keys and the value codec the values: the same payload, byte for byte, as the
    KV_2LTD chunk of the same keys and values, and the same decoded values."""
    kv = _kv()
    lay = VllmCpu(128, isa)
    fused = np.zeros((3, 256, 384), BFLOAT16)
    g = lay.geometry(fused.shape, 64, "chunk")
    lay.join([kv[0].copy(), kv[1].copy()], fused, g)
    codec = ChunkCodec(plane_layout=lay)
    buf, y = codec_roundtrip(codec, fused)
    twin, ty = codec_roundtrip(ChunkCodec(), kv)
    assert np.array_equal(buf[64:], twin[64:])
    h, th = read_header(buf), read_header(twin)
    assert (h["version"], th["version"]) == (3, 2)   # KV_2LTD stays wire version 2 (older readers read it)
    assert h["layout"] == lay and th["layout"] == KV_2LTD and buf[9] == lay.code and \
        struct.unpack_from("<H", buf, 10)[0] == 128
    yk, yv = lay.split(y, g)
    assert np.array_equal(yk.view(np.uint8), ty[0].view(np.uint8)) and np.array_equal(yv.view(np.uint8),
                                                                                         ty[1].view(np.uint8))
    assert kv.nbytes / buf.size > 3.5


def test_a_chunk_never_decodes_into_another_layout():
    kv = _kv()
    vec, amx = VllmCpu(128, "vec"), VllmCpu(128, "amx")
    fused = np.zeros((3, 256, 384), BFLOAT16)
    vec.join([kv[0].copy(), kv[1].copy()], fused, vec.geometry(fused.shape, 64, "c"))
    buf, _ = codec_roundtrip(ChunkCodec(plane_layout=vec), fused)
    out = np.zeros_like(fused)
    for other in (VllmCpu(64, "vec"), amx, MLA):
        with pytest.raises(FormatError, match="never decodes into another layout"):
            ChunkCodec(plane_layout=other).decode_into(buf, out)
    with pytest.raises(CodecError, match="which its shape cannot tell"):
        ChunkCodec().decode_into(buf, out)
    with pytest.raises(FormatError, match="never decodes into another layout"):   # a KV_2LTD destination
        ChunkCodec(plane_layout=vec).decode_into(buf, np.zeros_like(kv))
    twin, _ = codec_roundtrip(ChunkCodec(), kv)
    with pytest.raises(FormatError, match="never decodes into another layout"):   # and the other way
        ChunkCodec(plane_layout=vec).decode_into(twin, out)
    ChunkCodec(plane_layout=VllmCpu(128, "vec16")).decode_into(buf, out)          # vec16 is vec's order
    # 'auto' resolves as vLLM does on this host: a BF16 chunk is amx's order only where the CPU has AMX
    assert VllmCpu(128, "auto", host_amx=True).resolve("BF16", 64) == amx
    assert VllmCpu(128, "auto", host_amx=True).resolve("F16", 64) == vec
    assert VllmCpu(128, "auto", host_amx=False).resolve("BF16", 64) == vec
    assert VllmCpu(48, "auto", host_amx=True).resolve("BF16", 64) == VllmCpu(48, "vec")
    assert VllmCpu(128, "auto", host_amx=True).resolve("BF16", 80) == vec


def test_the_header_records_the_layout_and_refuses_what_it_does_not_know():
    kv = _kv()
    lay = VllmCpu(128, "vec")
    fused = np.zeros((3, 256, 384), BFLOAT16)
    lay.join([kv[0].copy(), kv[1].copy()], fused, lay.geometry(fused.shape, 64, "c"))
    buf, _ = codec_roundtrip(ChunkCodec(plane_layout=lay), fused)
    twin, _ = codec_roundtrip(ChunkCodec(), kv)
    cases = {}
    b = buf.copy(); b[9] = 9; cases["unknown layout"] = b                                      # noqa: E702
    b = buf.copy(); b[10:12] = np.frombuffer(struct.pack("<H", 0), np.uint8); cases["no block"] = b  # noqa: E702
    b = buf.copy(); b[9] = 0; b[10:12] = 0; cases["v3 KV_2LTD"] = b                             # noqa: E702
    b = twin.copy(); b[9] = 1; cases["v2 with a layout"] = b                                    # noqa: E702
    b = buf.copy(); b[4:6] = np.frombuffer(struct.pack("<H", 4), np.uint8); cases["v4"] = b     # noqa: E702
    for what, b in cases.items():
        with pytest.raises(FormatError, match="damaged|does not know|upgrade kvcx"):
            read_header(reseal(b))
    assert layout_from_wire(1, 128) == lay and layout_from_wire(2, 64) == VllmCpu(64, "amx")
    assert layout_from_wire(0, 0) == KV_2LTD and layout_from_wire(3, 0) == MLA and layout_from_wire(1, 3) is None


def test_an_mla_latent_plane_with_the_key_codec():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 256, 576)) * 2 + rng.standard_normal(576) * 4).astype(BFLOAT16)
    codec = ChunkCodec(plane_layout=MLA)
    buf, y = codec_roundtrip(codec, x)
    h = read_header(buf)
    assert h["layout"] == MLA and (h["kv_heads"], h["head_dim"]) == (1, 576) and h["value"] is None
    assert not buf[40:52].any()                         # no value codec: its fields are zeros
    # exactly the key codec on the plane: the payload of a KV_2LTD chunk's key half
    key_only = codec.config.key.encode(x)
    assert np.array_equal(buf[64:64 + key_only.codes.nbytes], key_only.codes)
    rel = np.sqrt(((y.astype(np.float32) - x.astype(np.float32)) ** 2).mean() / (x.astype(np.float32) ** 2).mean())
    assert rel < 0.1 and x.nbytes / buf.size > 3.3
    b = buf.copy()
    b[40] = 4                                           # a value codec where MLA has none
    with pytest.raises(FormatError, match="damaged"):
        read_header(reseal(b))
    with pytest.raises(CodecError, match="power of two"):   # a rotating key codec needs power-of-two heads
        ChunkCodec(KVConfig.from_scheme("symmetric", rotate=True), plane_layout=MLA).serialized_size(x.shape, BFLOAT16)


@pytest.mark.parametrize("shape,layout,match", [
    ((3, 256, 384), None, "which its shape cannot tell"),
    ((3, 200, 384), VllmCpu(128), "not a whole number of the engine's 128-token blocks"),
    ((3, 256, 320), VllmCpu(128), r"not a multiple of 2 \* head_dim"),
    ((3, 256, 240), VllmCpu(128, "amx"), r"not a multiple of 2 \* head_dim"),
    ((2, 3, 256, 2, 64), None, "KV_2LTD"),
    ((3, 3, 256, 128), None, "KV_2LTD"),
    ((256, 384), VllmCpu(128), "single plane"),
    ((3, 256, 0), VllmCpu(128), "empty"),
])
def test_chunks_that_do_not_fit_their_layout_are_refused(shape, layout, match):
    with pytest.raises(CodecError, match=match):
        ChunkCodec(plane_layout=layout).serialized_size(shape, BFLOAT16)


def test_layout_options():
    assert plane_layout(None) is None and plane_layout("auto") is None and plane_layout("kv_2ltd") is None
    assert plane_layout("mla") == MLA and plane_layout("vllm_cpu", 64, "amx") == VllmCpu(64, "amx")
    for args, match in [(("vllm_cpu",), "needs block_size"), (("vllm_cpu", 7), "even integer"),
                        (("vllm_cpu", 128, "sse"), "isa must be"), (("auto", 128), "set layout to 'vllm_cpu'"),
                        (("mla", 128), "no engine block"), (("paged",), "layout must be one of")]:
        with pytest.raises(CodecError, match=match):
            plane_layout(*args)
    with pytest.raises(CodecError, match="multiples of 16"):
        VllmCpu(40, "amx").geometry((1, 80, 256), 64, "chunk")
    with pytest.raises(CodecError, match="single-plane chunk layout"):
        ChunkCodec(plane_layout=KV_2LTD)
