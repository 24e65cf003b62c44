"""The Triton backend of the widths codec (kvcx.widths: kvcx2v's, kvcx2w's and kvcx4w's keys, the guard's 8-bit keys):
the CPU kernels' record bytes and decoded values, both ways, on random, degenerate and real cache data, and its
errors.

Without a GPU (CI) Triton's interpreter runs the kernels on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1);
with one they run on it. Nothing here is skipped for lack of a GPU.
"""

import numpy as np
import pytest
import torch

from kvcx.codecs import KVConfig, Packed, WidthCodec
from kvcx.codecs.gpu import to_host
from kvcx.codecs.tensors import numpy_to_torch, torch_to_numpy
from kvcx.errors import CodecError

from helpers import keys_like, random_array, same_records_both_ways

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x, weights=None, **settings):
    """x (NumPy) through the CPU kernels and (as a tensor) through Triton: the records (widths, range bytes, planes,
    channel ranges, sinks) and the decoded values equal bit for bit, and each side decodes the other's record to the
    same bits."""
    cpu_codec, tri_codec = WidthCodec(**settings), WidthCodec(**settings, backend="triton")
    cpu = cpu_codec.encode(x, weights=weights)
    gpu = tri_codec.encode(numpy_to_torch(x, DEVICE), weights=weights)
    assert gpu.codes.device.type == DEVICE and gpu.scales.device.type == DEVICE
    assert to_host(gpu).meta == cpu.meta
    same_records_both_ways(cpu_codec, tri_codec, cpu, gpu, DEVICE)
    return cpu


# kvcx2v's keys (2.71875 bits, groups of 64, a sink), kvcx2w's (2 bits, 32), the guard's 8 bits, every group size;
# odd lengths (a partial last group), a head dim that is not a power of two (80), sinks more than tokens, one token
@pytest.mark.parametrize("shape,settings", [
    ((2, 3, 150, 64), dict(bits=2.71875, group_size=64, sinks=1)),
    ((1, 2, 77, 64), dict(bits=2.0, group_size=32, sinks=1)),
    ((1, 2, 100, 80), dict(bits=2.71875, group_size=64, sinks=1)),
    ((3, 9, 16), dict(bits=8, group_size=16, sinks=2)),
    ((1, 1, 300, 32), dict(bits=1.0, group_size=128)),
    ((1, 2, 260, 24), dict(bits=3.5, group_size=256, sinks=3)),
    ((1, 1, 3, 64), dict(bits=2.0, group_size=32, sinks=4)),
    ((1, 1, 1, 8), dict(bits=2.0, group_size=32)),
], ids=str)
def test_same_bytes_as_the_cpu_kernels(shape, settings):
    _check(random_array(shape, np.float32, seed=len(shape) + shape[-1], scale=3.0, outlier_channels=2), **settings)
    _check(keys_like(shape, seed=shape[-2]), **settings)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"], ids=str)
def test_same_bytes_for_every_dtype(dtype):
    if dtype == "bfloat16":
        from kvcx.codecs.dtypes import BFLOAT16 as dtype
    _check(keys_like((2, 2, 90, 64), seed=3, dtype=dtype), bits=2.71875, group_size=64, sinks=1)


def test_same_bytes_on_degenerate_channels():
    """Flat channels (no range: no codes, decoded to the value), channels without bits (decoded to their group's
    mean), +0.0 and -0.0 in one channel (the CPU keeps the first of equal values: the range's sign bit), values of
    FP16's subnormal size, and a channel that holds one extreme."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 2, 130, 64)).astype(np.float32) * 0.01
    x[..., 0] = 1.5                                          # flat
    x[..., 1] = 0.0
    x[0, 0, ::3, 1] = -0.0                                   # signed zeros
    x[0, 1, 1::2, 1] = -0.0
    x[..., 2] = rng.standard_normal(130).astype(np.float32) * 1e-6   # subnormal in FP16
    x[0, 0, 40, 3] = 900.0                                   # one extreme
    x[..., 8:] *= 1e-3                                       # most channels flat next to the wide ones: no bits
    x[..., 4:8] *= 500.0
    p = _check(x, bits=2.0, group_size=32, sinks=1)
    assert (p.codes[:128] == 0).any()                        # channels without bits are in the test
    _check(np.zeros((1, 1, 64, 16), np.float32), bits=2.0, group_size=32)
    _check(-np.zeros((1, 1, 64, 16), np.float32), bits=2.0, group_size=32)


def test_same_bytes_with_key_weights():
    """kvcx calibrate's channel weights choose the widths on the host for both backends."""
    x = keys_like((1, 4, 96, 64), seed=8)
    weights = np.random.default_rng(2).uniform(0, 50, (2, 64))
    p = _check(x, weights=weights, bits=2.71875, group_size=64, sinks=1)
    assert not np.array_equal(p.codes[:256], WidthCodec(bits=2.71875, group_size=64, sinks=1).encode(x).codes[:256])


def test_real_cache_data(loaded):
    """Keys of the embedded model, first, middle and last layers, as kvcx2v and the guard (8 bits) encode them."""
    model, tok, _ = loaded
    ids = tok("The quick brown fox jumps over the lazy dog. " * 12, return_tensors="pt").input_ids[:, :133]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    key = KVConfig.from_scheme("kvcx2v").key.get_config()
    for layer in (0, len(cache.layers) // 2, len(cache.layers) - 1):
        keys = cache.layers[layer].keys.float().numpy()
        _check(keys, bits=key["bits"], group_size=key["group_size"], sinks=key["sinks"])
        _check(keys, bits=8, group_size=64, sinks=1)


def test_decode_into_a_longer_tensor_at_an_offset():
    x = keys_like((1, 2, 70, 64), seed=5)
    codec = WidthCodec(bits=2.71875, group_size=64, sinks=1, backend="triton")
    out = torch.full((1, 2, 130, 64), 7.0, device=DEVICE)
    codec.decode(codec.encode(numpy_to_torch(x, DEVICE)), out=out, token_offset=30)
    cpu = WidthCodec(bits=2.71875, group_size=64, sinks=1)
    assert np.array_equal(out[:, :, 30:100].cpu().numpy(), cpu.decode(cpu.encode(x)))
    assert bool((out[:, :, :30] == 7).all()) and bool((out[:, :, 100:] == 7).all())


def test_the_device_program_sizes_write_the_same_bytes(monkeypatch):
    """The interpreter holds more groups a program than a GPU (gpu_widths.ROW_VALUES): each group alone."""
    from kvcx.codecs import gpu_widths

    monkeypatch.setattr(gpu_widths, "INTERPRETER_ROW_VALUES", gpu_widths.ROW_VALUES)
    assert gpu_widths.row_programs(64) == 16
    _check(keys_like((2, 3, 200, 64), seed=9), bits=2.71875, group_size=64, sinks=1)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's NaN comparisons
def test_errors_name_the_tensor_and_say_what_to_do():
    """The CPU codec's messages, word for word."""
    codec, cpu = WidthCodec(bits=2.0, group_size=32, sinks=1, backend="triton"), WidthCodec(bits=2.0, group_size=32,
                                                                                            sinks=1)
    x = keys_like((1, 2, 100, 64))

    def same_error(y, **kw):
        with pytest.raises(CodecError) as got:
            codec.encode(numpy_to_torch(y, DEVICE), name="k", **kw)
        with pytest.raises(CodecError) as want:
            cpu.encode(y, name="k", **kw)
        assert str(got.value) == str(want.value)
        return str(got.value)

    for where in ((0, 1, 50, 7), (0, 0, 0, 3)):        # a coded token, a sink token
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[where] = bad
            assert "'k' contains 1 NaN/Inf" in same_error(y)
    assert "FP16" in same_error(x * 1e5)
    assert "key weights" in same_error(x, weights=np.ones((3, 64)))
    assert "multiple of 8" in same_error(np.zeros((1, 1, 64, 12), np.float32))
    with pytest.raises(CodecError, match="dtype torch.int32"):
        codec.encode(torch.ones(1, 2, 64, 64, dtype=torch.int32, device=DEVICE), name="k")
    p = codec.encode(numpy_to_torch(x, DEVICE), name="k")
    with pytest.raises(CodecError, match="out= records are for NumPy"):
        codec.encode(numpy_to_torch(x, DEVICE), out=p, name="k")
    with pytest.raises(CodecError, match="out must be"):
        codec.decode(p, out=torch.empty(1, 2, 100, 63, device=DEVICE), name="k")


def test_a_damaged_record_is_refused():
    """Widths that do not add up, range bytes out of order (the device's check), NaN ranges, short codes, NaN sinks:
    the CPU decoder's messages."""
    codec = WidthCodec(bits=2.0, group_size=32, sinks=1, backend="triton")
    p = codec.encode(numpy_to_torch(keys_like((1, 2, 100, 64)), DEVICE), name="k")
    N, D, G = 2, 64, -(-99 // 32)

    def refused(**fields):
        damaged = Packed(**{**p.__dict__, **fields})
        with pytest.raises(CodecError) as got:
            codec.decode(damaged, name="k")
        with pytest.raises(CodecError) as want:
            WidthCodec(bits=2.0, group_size=32, sinks=1).decode(to_host(damaged), name="k")
        assert str(got.value) == str(want.value)
        return str(got.value)

    codes = p.codes.clone()
    codes[0] += 1
    assert "widths" in refused(codes=codes) and "damaged" in refused(codes=codes)
    codes = p.codes.clone()
    codes[N * D:N * D + N * G * D * 2].view(N, G, D, 2)[0, 1, 5] = torch.tensor([200, 100], dtype=torch.uint8)
    assert "damaged" in refused(codes=codes)
    scales = p.scales.clone()
    scales[0, 3, 0] = float("nan")
    assert "channel ranges" in refused(scales=scales)
    assert "expected" in refused(codes=p.codes[:-1])
    sinks = p.sinks.clone()
    sinks.view(-1)[3] = float("nan")
    assert "exact sink tokens hold NaN/Inf" in refused(sinks=sinks)
    assert bool(torch.isfinite(codec.decode(p, name="k")).all())   # the record as written passes the same checks


@pytest.mark.parametrize("codec", [WidthCodec(bits=2.71875, group_size=64, sinks=1), KVConfig.from_scheme("kvcx2v").value,
                                   KVConfig.from_scheme().key, KVConfig.from_scheme().value], ids=lambda c: c.codec_id)
def test_a_decoder_checks_once_and_reads_nothing_back(codec, monkeypatch):
    """Codec.decoder(record): what a cache's device store calls at every step (DeviceChunkKV). On the Triton backend
    the record's checks run once, when it is made (a damaged record refused there, with decode()'s message); each
    call then decodes what decode() does, at any offset, and never reads the device back (no .item(), .tolist(),
    .cpu() or .numpy() in it). A NumPy record's decoder is decode()."""
    x = keys_like((1, 2, 100, 64), seed=4)
    host = codec.encode(x)
    run = codec.decoder(host, "k")
    assert np.array_equal(run(), codec.decode(host))
    dev = codec.with_backend("triton")
    p = dev.encode(numpy_to_torch(x, DEVICE))
    run = dev.decoder(p, "k")
    want = dev.decode(p)
    out = torch.full((1, 2, 130, 64), 7.0, device=DEVICE)
    for n in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, n, lambda self, *a, n=n, **k: pytest.fail(f"a decode step called .{n}()"))
    run(out, 20)
    monkeypatch.undo()
    assert torch.equal(out[:, :, 20:120], want) and bool((out[:, :, :20] == 7).all())
    assert np.array_equal(torch_to_numpy(want), codec.decode(host))
    # a damaged record is refused when its decoder is made: a scale no encoder writes
    bad = Packed(**{**p.__dict__})
    if codec.codec_id == "kvcx.widths":
        bad.scales = p.scales.clone()
        bad.scales.view(-1)[0] = float("nan")
    elif codec.codec_id == "kvcx.e8p":
        rec = p.codes.clone().view(-1, 64 // 4 + 2)
        rec[3, -2:] = torch.tensor([-1.0], dtype=torch.float16).view(torch.uint8).to(rec.device)
        bad.codes = rec.view(-1)
    else:
        bad.scales = p.scales.clone()
        bad.scales.view(-1)[0] = -1.0
    with pytest.raises(CodecError, match="'k'.*damaged") as got:
        dev.decoder(bad, "k")
    with pytest.raises(CodecError) as want_error:
        dev.decode(bad, name="k")
    assert str(got.value) == str(want_error.value)
