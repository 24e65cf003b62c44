"""The per-channel widths codec (kvcx.widths, --scheme kvcx2w) against its NumPy reference, its widths, its errors."""

import numpy as np
import pytest

from kvcx.codecs import IntCodec
from kvcx.errors import CodecError

from helpers import keys_like


@pytest.mark.parametrize("shape,bits,gs,sinks,dtype", [
    ((1, 3, 200, 64), 2.0, 32, 1, np.float32), ((2, 2, 100, 32), 3.5, 16, 2, np.float16),
    ((1, 1, 300, 64), 1.0, 128, 0, np.float32), ((4, 40, 16), 8, 32, 3, np.float32),
    ((1, 2, 70, 24), 2.5, 16, 1, np.float16)])
def test_widths_codec_matches_the_numpy_reference(shape, bits, gs, sinks, dtype):
    from kvcx.codecs import WidthCodec, decode

    from reference import widths_encode

    x = keys_like(shape, dtype=dtype)
    c = WidthCodec(bits=bits, group_size=gs, sinks=sinks)
    p = c.encode(x, name="k")
    codes, scales, dec = widths_encode(x, bits, gs, sinks)
    assert np.array_equal(p.codes, codes) and np.array_equal(p.scales, scales)
    y = decode(p)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, dec.astype(dtype))
    if sinks:
        np.testing.assert_array_equal(y[..., :sinks, :], x[..., :sinks, :])
    N = int(np.prod(shape[:-2]))
    widths = p.codes[:N * shape[-1]].reshape(N, -1)
    assert widths.sum() == round(bits * shape[-1]) * N and widths.max() <= 8
    # the buffers of an earlier Packed are reused
    q = c.encode(keys_like(shape, seed=1, dtype=dtype), name="k")
    assert c.encode(x, name="k", out=q) is q and np.array_equal(q.codes, p.codes)


def test_widths_follow_the_spread_and_the_weights():
    from kvcx.codecs import WidthCodec, decode

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 256, 64)).astype(np.float32)
    x[..., :8] *= 20        # wide channels
    x[..., 8:16] *= 0.01    # flat channels
    c = WidthCodec(bits=2.0, group_size=32, sinks=1)
    w = c.encode(x).codes[:128].reshape(2, 64)
    assert w[:, :8].min() > w[:, 16:].mean() > 1 and w[:, 8:16].max() == 0
    # the queries weigh channels 32-63 of head 0 a thousand times more: they get the bits, and their error falls
    weights = np.ones((2, 64))
    weights[0, 32:] = 1000.0
    pw = c.encode(x, weights=weights)
    ww = pw.codes[:128].reshape(2, 64)
    assert ww[0, 32:].mean() > w[0, 32:].mean() + 1
    err = lambda p: np.abs(decode(p) - x)[0, 0, 1:, 32:].mean()
    assert err(pw) < 0.6 * err(c.encode(x))
    # the heads share the tensor's budget: the weighted head takes bits from the other
    assert ww[0].sum() > ww[1].sum() and ww.sum() == w.sum() == 2 * 128


def test_a_channel_without_bits_decodes_to_its_groups_mean():
    """The encoder puts a width-0 channel's range bytes about its group's mean (widths.h kvcx_w_encode_tile; the
    decode is unchanged): it decodes within half a step of the channel's 255-step grid of the mean, one value a
    group, nearer the group overall than the middle of its min and max (the encoders before); channels with codes
    are as before."""
    from kvcx.codecs import WidthCodec, decode

    from reference import widths_encode

    x = keys_like((1, 3, 257, 64), seed=5)
    x[0, :, 100:110, ::3] += 6.0    # skewed groups: their mean is far from their middle
    p = WidthCodec(bits=1.5, group_size=64, sinks=1).encode(x, name="k")
    y = decode(p)
    widths = p.codes[:3 * 64].reshape(3, 64)
    lo, hi = p.scales[..., 0].astype(np.float32), p.scales[..., 1].astype(np.float32)
    groups = [(1 + 64 * g, min(257, 65 + 64 * g)) for g in range(4)]
    n, d = np.nonzero(widths == 0)
    assert n.size > 20
    *_, middle = widths_encode(x, 1.5, 64, 1, middle=True)
    sq = lambda z, a, b: ((z[0, n, a:b, d] - x[0, n, a:b, d]).astype(np.float64) ** 2).sum(1)
    for a, b in groups:
        err = np.abs(y[0, n, a, d] - x[0, n, a:b, d].astype(np.float64).mean(1))
        assert (err <= (hi[n, d] - lo[n, d]) / 255 / 2 * 1.001).all()
        assert (y[0, n, a:b, d] == y[0, n, a:a + 1, d]).all()
    assert sum(sq(y, a, b).sum() for a, b in groups) < 0.9 * sum(sq(middle, a, b).sum() for a, b in groups)
    coded = np.broadcast_to((widths > 0)[:, None, :], y[0].shape)
    np.testing.assert_array_equal(y[0][coded], middle[0][coded])


def test_widths_codec_errors():
    from kvcx.codecs import Packed, WidthCodec, decode

    with pytest.raises(CodecError, match="mean bits"):
        WidthCodec(bits=0)
    with pytest.raises(CodecError, match="mean bits"):
        WidthCodec(bits=9)
    with pytest.raises(CodecError, match="group size"):
        WidthCodec(group_size=24)
    c = WidthCodec(bits=2.01, group_size=32)     # 128.64 bits a slab: 128, rounded down
    p = c.encode(np.random.default_rng(0).standard_normal((1, 2, 64, 64)).astype(np.float32), name="k")
    assert p.codes[:2 * 64].sum() == 2 * 128 and decode(p).shape == (1, 2, 64, 64)
    with pytest.raises(CodecError, match="'k'.*less than one bit a slab"):
        WidthCodec(bits=0.01).encode(np.zeros((1, 1, 64, 64), np.float32), name="k")
    c = WidthCodec(bits=2.0, group_size=32, sinks=1)
    with pytest.raises(CodecError, match="multiple of 8"):
        c.encode(np.zeros((1, 1, 64, 12), np.float32), name="k")
    with pytest.raises(CodecError, match="at least 2 dims"):
        c.encode(np.zeros(64, np.float32), name="k")
    with pytest.raises(CodecError, match="empty"):
        c.encode(np.zeros((1, 0, 64), np.float32), name="k")
    x = keys_like((1, 2, 100, 64))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[0, 1, 50, 7] = bad
        with pytest.raises(CodecError, match="'k' contains 1 NaN/Inf"):
            c.encode(y, name="k")
    y = x.copy()
    y[0, 0, 0, 0] = np.nan    # a sink token
    with pytest.raises(CodecError, match="NaN/Inf"):
        c.encode(y, name="k")
    with pytest.raises(CodecError, match="FP16"):
        c.encode(x * 1e5, name="k")
    for w in (np.ones((3, 64)), np.ones((2, 32)), -np.ones((2, 64)), np.full((2, 64), np.nan)):
        with pytest.raises(CodecError, match="key weights"):
            c.encode(x, name="k", weights=w)
    with pytest.raises(CodecError, match="out must be a Packed"):
        c.encode(x, name="k", out=c.encode(keys_like((1, 2, 90, 64)), "k"))
    with pytest.raises(CodecError, match="'k'.*one width"):   # the one-width codec takes no channel weights
        IntCodec().encode(x, name="k", weights=np.ones((2, 64)))
    # damaged data: widths that do not add up, a range that ends below its start, NaN ranges, short codes
    p = c.encode(x, name="k")
    N, D, G = 2, 64, -(-99 // 32)

    def damaged(**kw):
        q = Packed(**{**p.__dict__, "codes": p.codes.copy(), "scales": p.scales.copy()})
        for k, v in kw.items():
            setattr(q, k, v)
        return q
    codes = p.codes.copy()
    codes[0] += 1
    with pytest.raises(CodecError, match="'k'.*widths.*damaged"):
        decode(damaged(codes=codes), name="k")
    codes = p.codes.copy()
    st = codes[N * D:N * D + N * G * D * 2].reshape(N, G, D, 2)
    st[0, 1, 5] = (200, 100)
    with pytest.raises(CodecError, match="'k'.*damaged"):
        decode(damaged(codes=codes), name="k")
    scales = p.scales.copy()
    scales[0, 3, 0] = np.nan
    with pytest.raises(CodecError, match="'k'.*channel ranges"):
        decode(damaged(scales=scales), name="k")
    with pytest.raises(CodecError, match="'k'.*expected"):
        decode(damaged(codes=p.codes[:-1]), name="k")
