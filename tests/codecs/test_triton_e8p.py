"""The Triton backend of the lattice codec (kvcx.e8p): the CPU kernels' record bytes and decoded values, both ways,
on random, tied and real cache data, and its errors.

Without a GPU (CI) Triton's interpreter runs the kernels on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1);
with one they run on it. Nothing here is skipped for lack of a GPU.
"""

import numpy as np
import pytest
import torch

from kvcx.cache.device_store import runs_on_device
from kvcx.codecs import E8PCodec, IntCodec, KVConfig, gpu_attn
from kvcx.codecs.gpu import to_host
from kvcx.codecs.tensors import numpy_to_torch
from kvcx.errors import CodecError, KvcxError

from helpers import keys_like, random_array, same_records_both_ways

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x, sinks=0):
    """x (NumPy) through the CPU kernels and (as a tensor) through Triton: the records and the decoded values equal
    bit for bit, and each side decodes the other's record to the same bits."""
    cpu_codec, tri_codec = E8PCodec(sinks=sinks), E8PCodec(sinks=sinks, backend="triton")
    cpu = cpu_codec.encode(x)
    gpu = tri_codec.encode(numpy_to_torch(x, DEVICE))
    return same_records_both_ways(cpu_codec, tri_codec, cpu, gpu, DEVICE)


# odd lengths, every head dim from 8 to 256, sinks more than tokens, one token
@pytest.mark.parametrize("shape,sinks", [((2, 3, 37, 64), 1), ((1, 2, 100, 32), 0), ((3, 9, 8), 2), ((2, 5, 256), 1),
                                         ((1, 1, 3, 128), 4), ((1, 1, 1, 16), 0)], ids=str)
def test_same_bytes_as_the_cpu_kernels(shape, sinks):
    _check(random_array(shape, np.float32, seed=len(shape) + shape[-1], scale=3.0, outlier_channels=2), sinks)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"], ids=str)
def test_same_bytes_for_every_dtype(dtype):
    if dtype == "bfloat16":
        from kvcx.codecs.dtypes import BFLOAT16 as dtype
    _check(keys_like((2, 2, 40, 64), seed=3, dtype=dtype), sinks=1)


def test_same_codes_where_the_search_ties():
    """Rows whose rotation has many equal coordinates put several lattice points at the same distance (zeros: 0
    is -1/4 from every shifted +1/4 coordinate); the search keeps the CPU's first best. Rows of a tiny scale (FP16
    subnormal) and of exact lattice points too."""
    D = 64
    rows = [np.zeros(D), np.ones(D), np.eye(D)[5] * 3, -np.ones(D), np.full(D, 1e-6), np.eye(D)[0] - np.eye(D)[1]]
    h = np.array([[1.0]])
    while h.shape[0] < D:
        h = np.block([[h, h], [h, -h]])
    point = np.tile([0.75, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25], D // 8)   # a point of E8P, rotated back
    rows.append(point @ h / np.sqrt(D))
    x = np.stack(rows).astype(np.float32).reshape(1, len(rows), D)
    _check(x)
    _check(np.repeat(x, 3, axis=1) * np.float32(0.5))


def test_real_cache_data(loaded):
    """Keys and values of the embedded model, every layer's first heads (kvcx2v's values are E8P)."""
    model, tok, _ = loaded
    ids = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids[:, :37]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    for layer in (0, len(cache.layers) // 2, len(cache.layers) - 1):
        for which in ("keys", "values"):
            _check(getattr(cache.layers[layer], which).float().numpy(), sinks=1)


def test_decode_into_a_longer_tensor_at_an_offset():
    x = keys_like((1, 2, 40, 64), seed=5)
    codec = E8PCodec(sinks=1, backend="triton")
    out = torch.full((1, 2, 100, 64), 7.0, device=DEVICE)
    codec.decode(codec.encode(numpy_to_torch(x, DEVICE)), out=out, token_offset=30)
    want = E8PCodec(sinks=1).decode(E8PCodec(sinks=1).encode(x))
    assert np.array_equal(out[:, :, 30:70].cpu().numpy(), want)
    assert bool((out[:, :, :30] == 7).all()) and bool((out[:, :, 70:] == 7).all())


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # the interpreter's FP16 scale
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")       # its NaN row, refused
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_errors_name_the_tensor_and_say_what_to_do():
    """The CPU codec's messages, word for word where the CPU has one."""
    codec, cpu = E8PCodec(sinks=1, backend="triton"), E8PCodec(sinks=1)
    bad = np.ones((2, 8, 64), np.float32)
    for where in ((1, 3, 5), (0, 0, 2)):           # a coded token, a sink token
        bad2 = bad.copy()
        bad2[where] = np.nan
        with pytest.raises(CodecError, match=r"'v'.*1 NaN/Inf") as got:
            codec.encode(numpy_to_torch(bad2, DEVICE), name="v")
        with pytest.raises(CodecError) as want:
            cpu.encode(bad2, name="v")
        assert str(got.value) == str(want.value)
    big = np.full((2, 8, 64), 1e5, np.float32)
    with pytest.raises(CodecError, match=r"'v'.*passes FP16.*1e\+05.*rescale") as got:
        codec.encode(numpy_to_torch(big, DEVICE), name="v")
    with pytest.raises(CodecError) as want:
        cpu.encode(big, name="v")
    assert str(got.value) == str(want.value)
    with pytest.raises(CodecError, match="power of two from 8"):
        codec.encode(torch.ones(2, 8, 48, device=DEVICE), name="v")
    with pytest.raises(CodecError, match="dtype torch.int32"):
        codec.encode(torch.ones(2, 8, 64, dtype=torch.int32, device=DEVICE), name="v")
    p = codec.encode(torch.randn(2, 8, 64, device=DEVICE), name="v")
    with pytest.raises(CodecError, match="out= records are for NumPy"):
        codec.encode(torch.ones(2, 8, 64, device=DEVICE), out=p, name="v")
    with pytest.raises(CodecError, match="out must be"):
        codec.decode(p, out=torch.empty(2, 8, 63, device=DEVICE), name="v")
    short = type(p)(**{**p.__dict__, "codes": p.codes[:-1]})
    with pytest.raises(CodecError, match=r"'v'.*expected \d+ E8P record bytes \(18 a token and head\)"):
        codec.decode(short, name="v")


@pytest.mark.parametrize("value", [float("nan"), -1.0, float("inf")])
def test_a_damaged_record_is_refused(value):
    """A record scale the encoder never writes (NaN, Inf, negative): the device check says the data is damaged, as
    the CPU's; so do NaN sink tokens."""
    codec = E8PCodec(sinks=1, backend="triton")
    p = codec.encode(torch.randn(2, 2, 40, 64, device=DEVICE))
    rec = p.codes.clone().view(-1, 64 // 4 + 2)
    rec[3, -2:] = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(rec.device)
    damaged = type(p)(**{**p.__dict__, "codes": rec.view(-1)})
    with pytest.raises(CodecError, match=r"'v'.*damaged: encode it again") as got:
        codec.decode(damaged, name="v")
    with pytest.raises(CodecError) as want:
        E8PCodec(sinks=1).decode(to_host(damaged), name="v")
    assert str(got.value) == str(want.value)
    assert bool(torch.isfinite(codec.decode(p, name="v")).all())   # the record as written passes the same checks
    sinks = type(p)(**{**p.__dict__, "sinks": p.sinks.clone()})
    sinks.sinks.view(-1)[3] = float("nan")
    with pytest.raises(CodecError, match=r"'v'.*exact sink tokens hold NaN/Inf"):
        codec.decode(sinks, name="v")


def test_a_cache_of_e8p_values_attends_over_what_it_decodes():
    """E8P runs on the device, but the fused attention there reads 4-bit integer records only: a layer with E8P
    values (kvcx2v: widths keys too, which also run there) keeps its records on the device and decodes them there
    (DeviceChunkKV); KvcxCache(backend='triton') takes them, and refuses a codec with no Triton kernels by name."""
    from kvcx.cache.device_store import decodes_on_device
    from kvcx.cache.layer_config import on_backend

    assert gpu_attn.reads(IntCodec()) and not gpu_attn.reads(E8PCodec()) and not gpu_attn.reads(IntCodec(bits=2))
    cuda = torch.device("cuda")
    assert runs_on_device(IntCodec(), IntCodec(), cuda) and not decodes_on_device(IntCodec(), IntCodec(), cuda)
    assert not runs_on_device(IntCodec(), E8PCodec(), cuda) and decodes_on_device(IntCodec(), E8PCodec(), cuda)
    mixed = on_backend(KVConfig(key=IntCodec(), value=E8PCodec(), scheme="mixed"), "triton", 2)
    assert mixed.value.backend == "triton"
    assert on_backend(KVConfig.from_scheme("kvcx2v"), "triton", 2).key.backend == "triton"
    with pytest.raises(KvcxError, match="runs 4-bit integer, E8P and widths codecs.*2-bit"):
        on_backend(KVConfig(key=IntCodec(bits=2), value=E8PCodec(), scheme="mixed"), "triton", 2)


def test_the_device_program_size_writes_the_same_bytes(monkeypatch):
    """The interpreter searches 256 vectors a program, a GPU 16 (gpu_lattice.SEARCH_VECTORS): each vector alone."""
    from kvcx.codecs import gpu_lattice

    monkeypatch.setattr(gpu_lattice, "INTERPRETER_SEARCH_VECTORS", gpu_lattice.SEARCH_VECTORS)
    _check(random_array((1, 2, 9, 64), np.float32, seed=9, scale=2.0), sinks=1)
