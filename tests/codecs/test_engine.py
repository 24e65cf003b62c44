"""The engine formats against independent references: llama.cpp's block types byte for byte against the
quantizers of the `gguf` package, vLLM's fp8 bit for bit against torch's float8 casts."""

import numpy as np
import pytest

from kvcx.codecs import Packed, decode, get_codec
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.codecs.engine import FP8Codec, GGMLCodec
from kvcx.codecs.kvconfig import ENGINE_SCHEMES, KVConfig
from kvcx.errors import CodecError

import gguf.quants as gquants  # the validate extra: CI installs it, these tests never skip
from gguf import GGMLQuantizationType as QT

# gguf's NumPy quantizers overflow on purpose in the subnormal block (1 / d is inf there, as in ggml's C)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

TYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1}
BPV = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0}


def hard_values(shape, seed):
    """Gaussian values with outliers, plus blocks made to hit the quantizers' edges: zeros, constants, ties
    on rounding boundaries, equal magnitudes of both signs (which value is 'max'), subnormals, a huge range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., :: max(1, shape[-1] // 5)] *= 20.0
    flat = x.reshape(-1, 32)
    n = flat.shape[0]
    flat[0 % n] = 0.0
    flat[1 % n] = 1.5
    flat[2 % n] = np.arange(32, dtype=np.float32) * 0.5 - 8.0           # steps of half a code
    flat[3 % n, :] = rng.standard_normal(32).astype(np.float32)
    flat[3 % n, 5], flat[3 % n, 9] = -7.0, 7.0                             # |min| == |max|
    flat[4 % n] = (rng.standard_normal(32) * 1e-40).astype(np.float32)    # subnormal floats
    flat[5 % n] = np.linspace(-1e4, 3e-3, 32, dtype=np.float32)
    flat[6 % n] = np.float32(1.0) + np.arange(32, dtype=np.float32) * np.float32(1 / 15)  # q4_1 ties
    return x


def gguf_blocks(packed, codec):
    """The llama.cpp blocks (d, [m], codes) of a record, as gguf lays them out."""
    d = packed.scales.reshape(-1, 1).view(np.uint8)
    parts = [d] + ([packed.zeros.reshape(-1, 1).view(np.uint8)] if codec.has_zeros else [])
    return np.concatenate(parts + [packed.codes.reshape(d.shape[0], -1)], axis=1)


def unsigned_zero_scales(blocks, n_fp16):
    """Blocks with the sign of zero FP16 d / m cleared. In a block whose values are all +-0, ggml's C reference
    (what llama.cpp runs) takes max = 0.0f (d = -0.0) and min = the first zero, while gguf's NumPy port takes
    x[0] and np.min: the two differ only in the sign of a zero scale, which decodes to the same zeros."""
    b = blocks.copy()
    for i in range(n_fp16):
        h = b[:, 2 * i:2 * i + 2].copy().view(np.uint16)
        h[h == 0x8000] = 0
        b[:, 2 * i:2 * i + 2] = h.view(np.uint8)
    return b


@pytest.mark.parametrize("type_", list(TYPES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("shape", [(1, 3, 37, 64), (2, 1, 5, 128), (1, 1, 9, 32)])
def test_ggml_blocks_are_gguf_byte_for_byte(type_, dtype, shape):
    x = hard_values(shape, seed=len(type_) + shape[-1]).astype(dtype)
    codec = GGMLCodec(type_)
    p = codec.encode(x)
    want = gquants.quantize(x.astype(np.float32).reshape(-1, shape[-1]), TYPES[type_])
    got = gguf_blocks(p, codec)
    assert np.array_equal(got.reshape(want.shape), want) or np.array_equal(
        unsigned_zero_scales(got, 1 + codec.has_zeros),
        unsigned_zero_scales(want.reshape(got.shape), 1 + codec.has_zeros))
    # decode is ggml's dequantize, bit for bit (rounded to the tensor's dtype as the cache would hold it)
    y = codec.decode(p, np.empty(shape, dtype))
    ref = gquants.dequantize(want, TYPES[type_]).reshape(shape).astype(dtype)
    assert np.array_equal(y.astype(np.float32), ref.astype(np.float32))   # every bit but the sign of a zero
    assert codec.bits_per_value() == BPV[type_] and 8 * p.nbytes / x.size == BPV[type_]


IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def iq4nl_index(a):
    """ggml's best_index_int8 on float32 arrays: the nearest codebook entry, the lower one on a tie."""
    mu = np.clip(np.searchsorted(IQ4NL, a, side="right"), 1, 15)
    lower = (a - IQ4NL[mu - 1]) < (IQ4NL[mu] - a)
    return np.where(a <= IQ4NL[0], 0, np.where(a >= IQ4NL[15], 15, np.where(lower, mu - 1, mu)))


def iq4nl_reference(x):
    """llama.cpp's KV write of iq4_nl (quantize_row_iq4_nl_ref: quantize_row_iq4_nl_impl with no importance
    weights and ntry = -1) in NumPy over many blocks at once, every float32 operation in its order:
    (FP16 d [n], codes [n, 32])."""
    f32 = np.float32
    x = x.reshape(-1, 32).astype(f32)
    rows = np.arange(len(x))
    first = np.argmax(np.abs(x), axis=1)      # the first of equal magnitudes, as ``if (ax > amax)`` keeps it
    live = np.abs(x[rows, first]) >= f32(1e-15)
    mx = np.where(live, x[rows, first], f32(1))
    with np.errstate(all="ignore"):
        d = mx / IQ4NL[0]
        codes = iq4nl_index((f32(1) / d)[:, None] * x)
        sqx, sq2 = np.zeros(len(x), f32), np.zeros(len(x), f32)
        for j in range(32):                   # the sums in the C loop's order
            q, w = IQ4NL[codes[:, j]], x[:, j] * x[:, j]
            sqx = sqx + w * q * x[:, j]
            sq2 = sq2 + w * q * q
        d = np.where(live, sqx / sq2, f32(0))
    return d.astype(np.float16), np.where(live[:, None], codes, 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("shape", [(1, 3, 37, 64), (1, 1, 9, 32)])
def test_iq4_nl_is_llama_cpps_kv_write_and_decodes_through_gguf(dtype, shape):
    x = hard_values(shape, seed=7 + shape[-1]).astype(dtype)
    codec = GGMLCodec("iq4_nl")
    p = codec.encode(x)
    d, codes = iq4nl_reference(x.astype(np.float32))
    assert np.array_equal(p.scales.reshape(-1).view(np.uint16), d.view(np.uint16))
    packed = (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)
    assert np.array_equal(p.codes.reshape(packed.shape), packed)
    # the blocks are llama.cpp's: gguf's dequantizer reads them, and decode equals it bit for bit
    blocks = gguf_blocks(p, codec)
    ref = gquants.dequantize(blocks, QT.IQ4_NL).reshape(shape).astype(dtype)
    assert np.array_equal(codec.decode(p, np.empty(shape, dtype)).astype(np.float32), ref.astype(np.float32))
    assert codec.bits_per_value() == 4.5 and 8 * p.nbytes / x.size == 4.5
    # the codebook and the refitted scale pay: on Gaussian blocks iq4_nl's error is below q4_0's at 4.5 bits
    g = np.random.default_rng(3).standard_normal((1, 4, 64, 64)).astype(np.float32)
    err = {t: float(np.mean((GGMLCodec(t).decode(GGMLCodec(t).encode(g)) - g) ** 2)) for t in ("iq4_nl", "q4_0")}
    assert err["iq4_nl"] < 0.9 * err["q4_0"], err


def hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("type_", ["q4_0", "q8_0", "q5_1"])
def test_rotation_is_llama_cpp_hadamard_of_64(type_):
    """rotate=True quantizes H x per run of 64 values (H: normalized Sylvester Hadamard) and decodes H q."""
    x = hard_values((1, 2, 16, 128), seed=3)
    codec = GGMLCodec(type_, rotate=True)
    y = codec.decode(codec.encode(x)).astype(np.float64)
    H = hadamard(64)
    hx = (x.astype(np.float64).reshape(-1, 64) @ H).astype(np.float32)
    blocks = gquants.quantize(hx, TYPES[type_])
    ref = gquants.dequantize(blocks, TYPES[type_]).astype(np.float64).reshape(-1, 64) @ H
    step = np.abs(hx).max() / (100 if type_ == "q8_0" else 6)
    assert np.abs(y.reshape(-1, 64) - ref).max() < step    # the same codes up to rotation rounding
    assert np.mean(np.abs(y.reshape(-1, 64) - ref) < 1e-4) > 0.99
    # what it is for: keys with outlier channels lose less at 4 and 5 bits rotated
    if type_ != "q8_0":
        k = hard_values((1, 2, 64, 64), seed=4)
        k[..., 5:64:16] *= 4.0
        k.reshape(-1, 32)[:8] = np.random.default_rng(4).standard_normal((8, 32))   # no crafted blocks here
        err = {r: np.square(c.decode(c.encode(k)).astype(np.float64) - k).mean()
               for r, c in ((True, codec), (False, GGMLCodec(type_)))}
        assert err[True] < err[False]


def test_key_rotation_runs_over_the_largest_power_of_two_of_the_head():
    """llama.cpp rotates K over the largest power of two dividing the head dim (build_input_k_rot) and V over
    64 (build_input_v_rot): the -rot schemes give the keys the K rule."""
    assert [GGMLCodec("q4_0", rotate="key").rotation_size(D) for D in (64, 128, 192, 256)] == [64, 128, 64, 256]
    assert [GGMLCodec("q4_0", rotate=True).rotation_size(D) for D in (64, 128, 256)] == [64, 64, 64]
    x = hard_values((1, 2, 8, 128), seed=9)
    x.reshape(-1, 32)[:8] = np.random.default_rng(9).standard_normal((8, 32))
    codec = GGMLCodec("q4_0", rotate="key")
    y = codec.decode(codec.encode(x))
    H = hadamard(128)
    hx = (x.astype(np.float64).reshape(-1, 128) @ H).astype(np.float32)
    ref = gquants.dequantize(gquants.quantize(hx, QT.Q4_0), QT.Q4_0).astype(np.float64).reshape(-1, 128) @ H
    assert np.mean(np.abs(y.reshape(-1, 128) - ref) < 1e-4) > 0.99
    assert not np.allclose(y, GGMLCodec("q4_0", rotate=True).decode(GGMLCodec("q4_0", rotate=True).encode(x)))
    cfg = KVConfig.from_scheme("q4_0-rot")
    assert cfg.key == GGMLCodec("q4_0", rotate="key") and cfg.value == GGMLCodec("q4_0", rotate=True)
    assert get_codec(cfg.key.get_config()) == cfg.key and eval(repr(cfg.key)) == cfg.key
    with pytest.raises(CodecError, match="'key'"):
        GGMLCodec("q4_0", rotate="value")


def test_rotation_needs_runs_of_64_and_falls_back():
    codec = GGMLCodec("q4_0", rotate=True)
    with pytest.raises(CodecError, match="runs over 64 values"):
        codec.encode(np.ones((1, 1, 4, 32), np.float32))
    assert codec.fallback() == GGMLCodec("q4_0") and codec.fallback().supports((1, 1, 4, 32))
    with pytest.raises(CodecError, match="blocks hold 32 values"):
        GGMLCodec("q8_0").encode(np.ones((4, 48), np.float32))


def torch_fp8(x32, fmt, scale):
    torch = pytest.importorskip("torch")
    dt, top = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}[fmt]
    t = torch.clamp(torch.from_numpy(x32) / scale, -top, top).to(dt)
    return t.view(torch.uint8).numpy(), (t.to(torch.float32) * scale).numpy()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("scale", [1.0, 0.125, "amax"])
def test_fp8_is_torch_cast_bit_for_bit(fmt, dtype, scale):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 3, 40, 64)) * np.float32(3.0)).astype(np.float32)
    x.reshape(-1)[:64] = np.ldexp(1.0, -np.arange(64) // 2 - 1)          # down into fp8 subnormals and below
    x.reshape(-1)[64:80] = [500, -500, 448, 464, 480, -449, 6e4, 6.5e4, 0.0, -0.0, 2 ** -9, 2 ** -10, 3 * 2 ** -10,
                            2 ** -16, 2 ** -17, 3 * 2 ** -17]            # saturation, ties, the smallest steps
    x = x.astype(dtype)
    codec = FP8Codec(fmt, scale)
    p = codec.encode(x)
    s = float(p.scales[0])
    if scale == "amax":
        top = 448.0 if fmt == "e4m3" else 57344.0
        assert s == float(np.float16(np.abs(x.astype(np.float32)).max() / top))
    else:
        assert s == scale
    codes, dec = torch_fp8(x.astype(np.float32), fmt, s)
    assert np.array_equal(p.codes, codes.reshape(-1))
    y = codec.decode(p)
    assert y.dtype == x.dtype and np.array_equal(y.view(np.uint8), dec.reshape(x.shape).astype(dtype).view(np.uint8))


def test_damaged_engine_records_are_errors():
    x = hard_values((1, 2, 8, 64), seed=1)
    for codec in (GGMLCodec("q4_1"), GGMLCodec("q8_0")):
        p = codec.encode(x)
        p.scales.reshape(-1)[3] = np.float16(np.inf)
        with pytest.raises(CodecError, match="damaged"):
            codec.decode(p)
    for fmt, bad in (("e4m3", 0x7F), ("e5m2", 0x7C), ("e5m2", 0xFE)):
        p = FP8Codec(fmt).encode(x)
        p.codes[5] = bad
        with pytest.raises(CodecError, match="damaged"):
            decode(p)
    p = FP8Codec("e4m3").encode(x)
    p.scales[1] = np.float16(2.0)
    with pytest.raises(CodecError, match="differ between slabs"):
        decode(p)
    p.scales[:] = np.float16(np.nan)
    with pytest.raises(CodecError, match="damaged"):
        decode(p)
    with pytest.raises(CodecError, match="NaN/Inf"):
        GGMLCodec("q4_0").encode(np.full((1, 1, 2, 32), np.nan, np.float32))
    with pytest.raises(CodecError, match="NaN/Inf"):
        FP8Codec("e4m3", "amax").encode(np.full((1, 1, 2, 32), np.inf, np.float32))


def test_engine_codecs_register_and_round_trip_configs():
    for c in (GGMLCodec("q5_0", rotate=True), FP8Codec("e5m2", "amax"), FP8Codec("e4m3", 0.5)):
        assert get_codec(c.get_config()) == c and eval(repr(c)) == c
    with pytest.raises(CodecError, match="not one kvcx emulates"):
        GGMLCodec("q3_k")
    with pytest.raises(CodecError, match="exact in FP16"):
        FP8Codec("e4m3", 0.1)   # 0.1 is not an FP16 number: the record could not hold it
    x = hard_values((1, 2, 8, 64), seed=2)
    p = GGMLCodec("q4_0").encode(x)
    out = Packed(codes=np.zeros_like(p.codes), scales=np.zeros_like(p.scales), zeros=None, sinks=None,
                 shape=p.shape, dtype=p.dtype, config=p.config)
    assert GGMLCodec("q4_0").encode(x, out) is out and np.array_equal(out.codes, p.codes)
    big = np.zeros((1, 2, 20, 64), np.float32)          # decode into a longer cache at a token offset
    GGMLCodec("q4_0").decode(p, big, token_offset=5)
    assert np.array_equal(big[:, :, 5:13], GGMLCodec("q4_0").decode(p)) and not big[:, :, :5].any()


def test_engine_schemes():
    for name in ENGINE_SCHEMES:
        cfg = KVConfig.from_scheme(name)
        assert cfg.scheme == name
        if name.startswith("turboquant_"):    # keys and values in formats of their own (test_turboquant.py)
            assert cfg.value.get_config() == {"id": "vllm.turboquant", "part": "value", "norm_correction": False,
                                              "bits": 3 if name == "turboquant_3bit_nc" else 4}
            continue
        assert cfg.key == cfg.value or name.endswith("-rot") and cfg.key.rotate == "key"
        assert cfg.key.get_config()["id"] in ("llama.cpp", "vllm.fp8", "fp4")
    assert KVConfig.from_scheme("q4_0-rot").value == GGMLCodec("q4_0", rotate=True)
    assert KVConfig.from_scheme("q4_0").bits_per_value(4) == 4.5
    with pytest.raises(CodecError, match="leave out group_size=64, bits=4"):
        KVConfig.from_scheme("q8_0", group_size=64, bits=4)
