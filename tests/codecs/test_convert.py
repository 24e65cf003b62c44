"""Precision conversion between float32, float16 and bfloat16: bit-exact with NumPy."""

import numpy as np
import pytest

from kvcx.codecs.convert import convert, to_float16, to_float32
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import CodecError


def test_all_65536_halves_to_float32_exact():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    ours = to_float32(h)
    ref = h.astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def _f32_sample(n=2_000_000, seed=1):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, -65520.0, 6.1035156e-05,
                      5.96e-08, 2.98e-08, 2.9802322e-08, 2.9802326e-08, 1e-45, 3.4e38, 1.0, -1.0,
                      0.1, 1 / 3, 2049.0, 2050.0, 2051.0, 1.0009765625, 1.00048828125], dtype=np.float32)
    # values around every half-precision rounding boundary
    h = np.arange(0, 0x7c00, 97, dtype=np.uint16).view(np.float16).astype(np.float32)
    nxt = np.nextafter(h, np.float32(np.inf))
    mid = ((h.astype(np.float64) + np.nextafter(h.astype(np.float16), np.float16(np.inf)).astype(np.float64)) / 2
           ).astype(np.float32)
    return np.concatenate([bits.view(np.float32), edges, h, nxt, mid, -mid,
                           np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])


def test_float32_to_float16_round_to_nearest_even():
    x = _f32_sample()
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(np.float16)
    ours = to_float16(x)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)  # NaN stays NaN
    assert np.array_equal(ours[~nan].view(np.uint16), ref[~nan].view(np.uint16))


def test_bfloat16_roundtrip_exact():
    b = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(BFLOAT16)
    ours = to_float32(b)
    ref = b.astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    x = _f32_sample(200_000)
    back = convert(x, BFLOAT16)
    with np.errstate(invalid="ignore", over="ignore"):
        refb = x.astype(BFLOAT16)
    nanb = np.isnan(refb.astype(np.float32))
    assert np.array_equal(back.view(np.uint16)[~nanb], refb.view(np.uint16)[~nanb])


def test_out_parameter_and_errors():
    x = np.linspace(-3, 3, 1001, dtype=np.float32)
    out = np.empty(1001, np.float16)
    assert to_float16(x, out=out) is out
    with pytest.raises(CodecError, match="out must be a writeable C-contiguous float16 array of shape"):
        to_float16(x, out=np.empty(10, np.float16))
    with pytest.raises(CodecError, match="has dtype int32"):
        to_float32(np.arange(4, dtype=np.int32))
    with pytest.raises(CodecError, match="target dtype float64"):
        convert(x, np.float64)
