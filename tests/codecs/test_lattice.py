"""The E8P lattice codec (kvcx.e8p, docs/FORMAT.md 2.8): the codebook is QuIP#'s E8P (2^16 distinct points of the
E8 lattice shifted by 1/4), the kernels' search finds the exact nearest point (checked against all 65,536), records
decode as the format defines them (a numpy decoder written from the text), and bad input is refused by name."""
import numpy as np
import pytest
from scipy.linalg import hadamard

from kvcx.codecs import IntCodec, KVConfig, decode, get_codec
from kvcx.codecs.lattice import E8PCodec, e8p_grid, e8p_points
from kvcx.errors import CodecError

ALL = e8p_points(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)).astype(np.float64)


def _rotate(x):
    D = x.shape[-1]
    return x.astype(np.float64) @ (hadamard(D) / np.sqrt(D))


def _rows(p, D):
    """(codes [rows, D / 8] uint16, scales [rows] float32) of a Packed's records."""
    rec = p.codes.reshape(-1, D // 4 + 2)
    return rec[:, :D // 4].copy().view(np.uint16), rec[:, D // 4:].copy().view(np.float16)[:, 0].astype(np.float32)


def test_the_codebook_is_e8_shifted_by_a_quarter_and_whole():
    assert e8p_grid().shape == (256, 8) and (np.abs(e8p_grid()) % 2 == 1).all()
    assert len(np.unique(ALL, axis=0)) == 1 << 16
    t = np.where(np.arange(1 << 16) >> 15, -0.25, 0.25)[:, None]
    pts = ALL - t            # each point less its shift is in E8: all integers or all halves, summing to an even
    whole = np.all(np.isclose(pts, np.round(pts)), 1)
    half = np.all(np.isclose(pts - 0.5, np.round(pts - 0.5)), 1)
    assert (whole | half).all() and np.allclose(pts.sum(1) % 2, 0)
    assert ((e8p_grid() / 2.0) ** 2).sum(1).max() == 12   # QuIP#'s E8P12: the norm-12 patterns included


@pytest.mark.parametrize("D", [8, 64, 128])
def test_codes_are_the_nearest_points_and_decode_as_the_format_says(D):
    rng = np.random.default_rng(D)
    x = (rng.standard_normal((3, 40, D)) * rng.uniform(0.1, 30, (3, 40, 1))).astype(np.float32)
    x[0, 5] = 0.0
    codec = E8PCodec(n_threads=1)
    p = codec.encode(x)
    assert p.codes.size == 3 * 40 * (D // 4 + 2) and codec.bits_per_value(D) == 2 + 16 / D
    codes, s = _rows(p, D)
    assert s[5] == 0.0 and (s >= 0).all()
    y = _rotate(x).reshape(-1, D)
    search = (np.sqrt((y ** 2).mean(1)) / 1.03).astype(np.float16).astype(np.float32)
    assert np.array_equal(s, (search * np.float32(1.09)).astype(np.float16).astype(np.float32))   # the decode's
    z = (y / np.where(search > 0, search, 1)[:, None]).reshape(-1, 8)[:600]
    got = e8p_points(codes.reshape(-1))[:600].astype(np.float64)
    d_got = ((z - got) ** 2).sum(1)
    d_best = (((z[:, None, :] - ALL[None, :, :]) ** 2).sum(2)).min(1)
    assert np.all(d_got <= d_best + 1e-4)                          # float32 rotation: ties within its rounding
    assert np.mean(d_got <= d_best + 1e-9) > 0.99
    # the numpy decoder from the format's text: points x scale, rotated back
    mine = (e8p_points(codes).reshape(-1, D) * s[:, None]).astype(np.float64) @ (hadamard(D) / np.sqrt(D))
    out = codec.decode(p)
    assert np.allclose(out.reshape(-1, D), mine, rtol=1e-5, atol=1e-5 * float(np.abs(mine).max()))
    assert np.array_equal(out[0, 5], np.zeros(D, np.float32))


def test_error_beats_two_bit_integer_codes_on_rotated_rows():
    """E8P at 2.25 bits a value (head dim 64): relative MSE about 0.097 on Gaussian rows (0.089 at the search's
    scale, times 1.09 for a decode unbiased along the row), against kvcx2's values (2-bit asymmetric after the same
    rotation, groups of 64: 2.5 bits) and symmetric 3-bit codes (3.25 bits)."""
    x = np.random.default_rng(5).standard_normal((8, 512, 64)).astype(np.float32)

    def rel(codec):
        return float(((codec.decode(codec.encode(x)) - x) ** 2).mean() / (x ** 2).mean())

    e8p = rel(E8PCodec())
    assert 0.09 < e8p < 0.1
    # unbiased along the row: the decode's projection on x is x's energy (at the search's scale it is 8 % short),
    # so the error an attention row sums over many tokens averages out instead of shrinking the output
    y = E8PCodec().decode(E8PCodec().encode(x)).astype(np.float64)
    assert abs(float((y * x).sum() / (x.astype(np.float64) ** 2).sum()) - 1.0) < 0.005
    assert e8p < 0.75 * rel(IntCodec(bits=2, scheme="asymmetric", rotate=True))
    assert e8p < rel(IntCodec(bits=3, scheme="symmetric", rotate=True)) * 2


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_sinks_out_and_offsets(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 10, 64)).astype(dtype)
    codec = E8PCodec(sinks=2)
    p = codec.encode(x)
    assert p.codes.size == 2 * 3 * 8 * 18 and p.sinks.shape == (2, 3, 2, 64) and p.config == {"id": "kvcx.e8p",
                                                                                                 "sinks": 2}
    y = decode(p)
    assert y.dtype == dtype and np.array_equal(y[..., :2, :], x[..., :2, :])
    assert get_codec(p.config) == codec
    again = codec.encode(x * 2, out=p)
    assert again is p and np.allclose(decode(p)[..., 2:, :], 2 * y[..., 2:, :], rtol=2e-2, atol=2e-2)
    big = np.zeros((2, 3, 16, 64), dtype)
    codec.decode(p, out=big, token_offset=4)
    assert np.array_equal(big[..., 4:14, :], decode(p)) and not big[..., :4, :].any()
    short = codec.encode(x[..., :1, :])          # every token a sink
    assert short.codes.size == 0 and np.array_equal(decode(short), x[..., :1, :])


def test_bad_input_is_refused_by_name():
    with pytest.raises(CodecError, match="'k'.*power of two from 8.*last dim is 96"):
        E8PCodec().encode(np.ones((1, 2, 96), np.float32), name="k")
    bad = np.random.default_rng(4).standard_normal((1, 4, 64)).astype(np.float32)
    bad[0, 2, 7] = np.nan
    with pytest.raises(CodecError, match="'v' contains 1 NaN/Inf"):
        E8PCodec().encode(bad, name="v")
    bad[0, 2, 7] = 0
    bad[0, 0, 1] = np.inf
    with pytest.raises(CodecError, match="'v' contains 1 NaN/Inf"):
        E8PCodec(sinks=1).encode(bad, name="v")
    with pytest.raises(CodecError, match="'v'.*scale passes FP16.*rescale"):
        E8PCodec().encode(np.full((1, 2, 64), 1e6, np.float32), name="v")
    with pytest.raises(CodecError, match="no key weights"):
        E8PCodec().encode(np.ones((1, 2, 64), np.float32), weights=np.ones((1, 64)))
    with pytest.raises(CodecError, match="sinks must be"):
        E8PCodec(sinks=-1)
    x = np.random.default_rng(2).standard_normal((1, 3, 64)).astype(np.float32)
    for byte in (0x7C, 0x80 | 0x3C, 0x7E):       # the scale's high byte: Inf, negative, NaN
        p = E8PCodec().encode(x)
        p.codes[17] = byte
        with pytest.raises(CodecError, match="damaged"):
            decode(p, name="v")
    p = E8PCodec().encode(x)
    p.codes = p.codes[:-1]
    with pytest.raises(CodecError, match="expected 54 E8P record bytes"):
        decode(p)


def test_a_file_with_e8p_values(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from kvcx.api import compress_kv_cache, decompress_kv_cache

    x = np.random.default_rng(6).standard_normal((1, 2, 33, 64)).astype(np.float16)
    cfg = KVConfig(key=IntCodec(bits=4, axis="channel", scheme="asymmetric", sinks=1), value=E8PCodec(sinks=1))
    src, packed, back = (tmp_path / f"{n}.safetensors" for n in ("src", "packed", "back"))
    save_file({"layer_0_key": x, "layer_0_value": x}, str(src))
    compress_kv_cache(src, packed, config=cfg)
    with safe_open(str(packed), "np") as f:
        assert f.metadata()["kvcx.format_version"] == "7"
    decompress_kv_cache(packed, back)
    assert np.array_equal(load_file(str(back))["layer_0_value"], cfg.value.decode(cfg.value.encode(x)))


def test_kvcx2v_preset_counts_at_most_2_75_bits_whole(tmp_path):
    """kvcx2v: keys with a width per channel (87/32 bits on average, groups of 64 tokens), E8P values, the sink token of
    each exact: a file of a 1,024-token cache (30 layers' worth of heads: 3 KV heads of 64) holds at most 2.75 bits a
    value, every byte of it counted (codes, scales, ranges, widths, sinks, the header)."""
    from safetensors.numpy import save_file

    from kvcx.api import compress_kv_cache
    from kvcx.codecs.widths import WidthCodec

    cfg = KVConfig.from_scheme("kvcx2v")
    assert cfg.key == WidthCodec(bits=2.71875, group_size=64, sinks=1) and cfg.value == E8PCodec(sinks=1)
    assert KVConfig.from_scheme("kvcx2v", sinks=0).value == E8PCodec()
    with pytest.raises(CodecError, match="kvcx2v.*no groups to size"):
        KVConfig.from_scheme("kvcx2v", group_size=32)
    with pytest.raises(CodecError, match="kvcx2v.*sets its own bits"):
        KVConfig.from_scheme("kvcx2v", bits=3)
    rng = np.random.default_rng(7)
    tensors = {f"layer_{i}_{kind}": rng.standard_normal((1, 3, 1024, 64)).astype(np.float16)
               for i in range(30) for kind in ("key", "value")}
    src, packed = tmp_path / "src.safetensors", tmp_path / "packed.safetensors"
    save_file(tensors, str(src))
    compress_kv_cache(src, packed, scheme="kvcx2v")
    values = sum(a.size for a in tensors.values())
    assert 8 * packed.stat().st_size / values <= 2.75
