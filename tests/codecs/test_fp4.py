"""FP4 KV formats against references nobody here wrote: ggml's MXFP4 blocks byte for byte against the `gguf`
package's quantizer and dequantizer; TensorRT-LLM's NVFP4 layout byte for byte against torchao's reference
(``nvfp4_quantize`` and ``NVFP4Tensor.dequantize``), and its values through gguf's NVFP4 type too."""

import warnings

import numpy as np
import pytest
import torch

from kvcx.api import compress_kv_cache, decompress_kv_cache
from kvcx.codecs import decode, get_codec
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.codecs.engine import FP4Codec
from kvcx.codecs.kvconfig import KVConfig
from kvcx.errors import CodecError

import gguf.quants as gquants   # the validate extra: CI installs it
from gguf import GGMLQuantizationType as QT

with warnings.catch_warnings():   # the test extra: CI installs it; its CUDA kernels are not needed (nor loadable here)
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]


def kv_like(shape, seed, dtype):
    """Gaussian rows at scales from 0.01 to 30 (keys' and values' ranges), outlier channels, a zero row, and
    groups whose scale is exactly 1 (amax 6) holding every rounding tie of E2M1 and a negative zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * rng.uniform(0.01, 30, shape[:-1] + (1,))
    x[..., ::17] *= 8.0
    flat = x.reshape(-1, 32)
    flat[0] = 0.0
    flat[1, :16] = [6.0] + TIES
    flat[1, 16:] = [-6.0] + TIES
    flat[2] = np.ldexp(1.0, -np.arange(32) // 2)                 # powers of two: the E8M0 exponent's edges
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("shape", [(1, 3, 37, 64), (2, 2, 5, 128), (1, 1, 9, 32)])
def test_mxfp4_is_gguf_byte_for_byte(dtype, shape):
    x = kv_like(shape, seed=shape[-1], dtype=dtype)
    codec = get_codec({"id": "fp4", "format": "mxfp4"})
    p = codec.encode(x)
    want = gquants.quantize(x.astype(np.float32).reshape(-1, shape[-1]), QT.MXFP4)
    assert np.array_equal(p.codes, want.reshape(-1))
    y = codec.decode(p)
    ref = gquants.dequantize(want, QT.MXFP4).reshape(shape).astype(dtype)
    assert y.dtype == x.dtype and np.array_equal(y.view(np.uint8), ref.view(np.uint8))
    assert codec.bits_per_value() == 4.25 and 8 * p.nbytes / x.size == 4.25


def torchao_nvfp4(x, p):
    """torchao's NVFP4 of a [rows, D] float32 array with per-tensor scale p: (code bytes, scale bytes, decode)."""
    pts = torch.tensor(p, dtype=torch.float32)
    scales, qdata = nvfp4_quantize(torch.from_numpy(x), 16, pts)
    y = NVFP4Tensor(qdata, scales, 16, torch.float32, per_tensor_scale=pts).dequantize(torch.float32)
    return qdata.numpy().reshape(-1), scales.view(torch.uint8).numpy().reshape(-1), y.numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("scale", [1.0, 0.25, "amax"])
def test_nvfp4_is_torchaos_reference_byte_for_byte(dtype, scale):
    shape = (2, 3, 21, 64)
    x = kv_like(shape, seed=5, dtype=dtype)
    x.reshape(-1, 16)[7] = np.ldexp(1.0, -np.arange(16) - 4)           # a group whose scale clamps at E4M3's 2^-6
    codec = FP4Codec("nvfp4", scale)
    p = codec.encode(x)
    s = float(p.scales[0])
    if scale == "amax":    # amax / (448 * 6), rounded up to FP16: no group scale passes 448
        want = np.abs(x.astype(np.float32)).max() / (448 * 6)
        assert s >= want and float(np.nextafter(np.float16(s), np.float16(0))) < want
    else:
        assert s == scale and (p.scales == p.scales[0]).all()
    codes, scales, ref = torchao_nvfp4(x.astype(np.float32).reshape(-1, shape[-1]), s)
    n = x.size // 2
    assert np.array_equal(p.codes[:n], codes) and np.array_equal(p.codes[n:], scales)
    y = codec.decode(p)
    assert y.dtype == x.dtype and np.array_equal(y.view(np.uint8), ref.reshape(shape).astype(dtype).view(np.uint8))
    assert codec.bits_per_value() == 4.5


def test_nvfp4_values_decode_through_ggmls_nvfp4_type():
    """ggml's NVFP4 (gguf: dequantize only) holds the same E4M3 scale bytes and E2M1 codes without a per-tensor
    scale, four groups to a 36-byte block, a group's nibbles as values j and j + 8: kvcx's bytes regrouped so
    decode through gguf to kvcx's values."""
    x = kv_like((1, 2, 12, 64), seed=3, dtype=np.float32)
    codec = FP4Codec("nvfp4", 1.0)
    p = codec.encode(x)
    n = x.size // 2
    nib = np.stack([p.codes[:n] & 0x0F, p.codes[:n] >> 4], axis=1).reshape(-1, 4, 16)   # codes in value order
    body = (nib[:, :, :8] | (nib[:, :, 8:] << 4)).reshape(-1, 32)
    blocks = np.concatenate([p.codes[n:].reshape(-1, 4), body], axis=1).astype(np.uint8)
    ref = gquants.dequantize(blocks, QT.NVFP4).reshape(x.shape)
    assert np.array_equal(codec.decode(p), ref)


def test_fp4_schemes_files_and_errors(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    x = kv_like((1, 2, 16, 64), seed=9, dtype=np.float16)
    for name, bpv in (("mxfp4", 4.25), ("nvfp4", 4.5), ("nvfp4-amax", 4.5)):
        cfg = KVConfig.from_scheme(name)
        assert cfg.key == cfg.value and cfg.key.get_config()["id"] == "fp4" and cfg.bits_per_value(4) == bpv
        assert get_codec(cfg.key.get_config()) == cfg.key and eval(repr(cfg.key), {"FP4Codec": FP4Codec}) == cfg.key
        src, packed, back = (tmp_path / f"{name}{i}.safetensors" for i in range(3))
        save_file({"layer_0_key": x, "layer_0_value": x * 0.5}, str(src))
        compress_kv_cache(src, packed, scheme=name)
        with safe_open(str(packed), "np") as f:
            assert f.metadata()["kvcx.format_version"] == "5"     # readers before FP4 refuse it, never misread
        decompress_kv_cache(packed, back)
        want = cfg.key.decode(cfg.key.encode(x))
        assert np.array_equal(load_file(str(back))["layer_0_key"], want)
    with pytest.raises(CodecError, match="groups hold 32 values of the last dim, which is 48"):
        FP4Codec("mxfp4").encode(np.ones((1, 2, 48), np.float32), name="k")
    with pytest.raises(CodecError, match="groups hold 16 values of the last dim, which is 24"):
        FP4Codec("nvfp4").encode(np.ones((1, 2, 24), np.float32), name="k")
    with pytest.raises(CodecError, match="'k'.*passes E4M3's 448.*up to 3000.*nvfp4-amax"):
        FP4Codec("nvfp4").encode(np.full((1, 2, 16), 3000.0, np.float32), name="k")
    big = np.full((1, 2, 16), 3000.0, np.float32)     # the calibrated scale holds it (up to its FP16 rounding)
    assert np.allclose(FP4Codec("nvfp4", "amax").decode(FP4Codec("nvfp4", "amax").encode(big)), big, rtol=2 ** -10)
    with pytest.raises(CodecError, match="'k' has values too large for FP16 scales"):
        FP4Codec("nvfp4", "amax").encode(np.full((1, 2, 16), 3e8, np.float32), name="k")
    for codec in (FP4Codec("mxfp4"), FP4Codec("nvfp4", "amax")):
        bad = np.ones((1, 2, 32), np.float32)
        bad[0, 1, 3] = np.nan
        with pytest.raises(CodecError, match="NaN/Inf"):
            codec.encode(bad, name="v")
    with pytest.raises(CodecError, match=r"engine's format.*leave out group_size=32$"):
        KVConfig.from_scheme("nvfp4", group_size=32)       # no '-rot' hint where the format has no rotation
    with pytest.raises(CodecError, match="leave out bits=2 \\(its rotation is the scheme 'q4_0-rot'\\)"):
        KVConfig.from_scheme("q4_0", bits=2)
    with pytest.raises(CodecError, match="no per-tensor scale"):
        FP4Codec("mxfp4", "amax")
    with pytest.raises(CodecError, match="'mxfp4' or 'nvfp4'"):
        FP4Codec("fp4_e3m0")
    with pytest.raises(CodecError, match="exact in FP16"):
        FP4Codec("nvfp4", 0.1)


def test_damaged_fp4_records_are_errors():
    x = kv_like((1, 2, 8, 64), seed=4, dtype=np.float32)
    p = FP4Codec("mxfp4").encode(x)
    p.codes[17] = 0xFF                                   # a block's exponent: E8M0's NaN
    with pytest.raises(CodecError, match="damaged"):
        decode(p)
    for byte in (0x7F, 0x88, 0x03):                      # NaN, negative, below the 2^-6 the encoder clamps to
        p = FP4Codec("nvfp4").encode(x)
        p.codes[x.size // 2 + 5] = byte
        with pytest.raises(CodecError, match="damaged"):
            decode(p)
    p = FP4Codec("nvfp4", "amax").encode(x)
    p.scales[1] = np.float16(2.0)
    with pytest.raises(CodecError, match="damaged"):
        decode(p)
    p.scales[:] = np.float16(np.inf)
    with pytest.raises(CodecError, match="damaged"):
        decode(p)
