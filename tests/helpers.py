"""Helpers shared by the tests: test data, the codec's error bound, the CLI runner, a packed-file reseal."""
import struct

import numpy as np
from typer.testing import CliRunner

from kvcx.cli import app
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.codecs.kvconfig import KVConfig
from kvcx.formats.packed import crc32

DTYPES = [np.float16, np.float32, BFLOAT16]


KV_SHAPES = [(1, 3, 37, 64), (2, 4, 128, 64), (1, 1, 5, 128)]


GENERIC_SHAPES = [(1000,), (7, 24), (3, 1, 9, 16), (1,)]


def random_array(shape, dtype, seed=0, scale=1.0, outlier_channels=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * scale
    if outlier_channels and len(shape) >= 2:
        x[..., rng.choice(shape[-1], outlier_channels, replace=False)] *= 8.0
    return x.astype(dtype)


def max_step(x, bits, asym):
    """An upper bound of one quantization step for any group of x."""
    a = np.asarray(x, dtype=np.float32)
    span = float(a.max() - a.min()) if asym else 2.0 * float(np.abs(a).max())
    levels = (2 ** bits - 1) if asym else (2 ** bits - 2)
    return span / levels


def check_roundtrip(codec, x):
    """Encode/decode; shape and dtype kept, every error within half a step (plus FP16 scale rounding)."""
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = np.abs(y.astype(np.float32) - x.astype(np.float32))
    bound = 0.5 * max_step(x, codec.bits, codec.asym) * 1.01 + 2e-3 * float(np.abs(x.astype(np.float32)).max())
    if codec.rotate:  # errors are bounded in the rotated space; rotation preserves the L2 norm per token
        bound *= np.sqrt(x.shape[-1])
    assert float(err.max()) <= bound, (float(err.max()), bound)
    return p, y


def tinyllama_cache(seq=128, dtype=np.float16, seed=0, outlier=1.0, layers=22, heads=4):
    """`layers` x K, V [1, heads, seq, 64] (TinyLlama's 22 x 4 by default, SmolLM2's 30 x 3 for its plans);
    `outlier` scales two key channels (real keys have such channels)."""
    rng = np.random.default_rng(seed)
    t = {}
    for i in range(layers):
        k = rng.standard_normal((1, heads, seq, 64)).astype(np.float32)
        k[..., [3, 17]] *= outlier
        t[f"layer_{i}_key"] = (0.5 * k).astype(dtype)
        t[f"layer_{i}_value"] = (0.5 * rng.standard_normal((1, heads, seq, 64))).astype(dtype)
    return t


def small_cache():
    return {"layer_0_key": random_array((1, 2, 8, 16), np.float16, seed=1, outlier_channels=2),
            "layer_0_value": random_array((1, 2, 8, 16), np.float16, seed=2),
            "positions": np.arange(8, dtype=np.int64)}


def bits_of(a):
    """An array's bits as unsigned integers of its item size (values compared bit for bit: NaN, -0.0)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def same_records_both_ways(cpu_codec, tri_codec, cpu, gpu, device):
    """A codec's CPU record ``cpu`` and Triton record ``gpu`` of the same tensor: the same bytes (codes, scales or
    ranges, sinks, config), and each backend decodes either record to the same bits. Returns the decoded values."""
    from kvcx.codecs.gpu import to_device, to_host
    from kvcx.codecs.tensors import torch_to_numpy

    host = to_host(gpu)
    assert host.shape == cpu.shape and host.dtype == cpu.dtype and host.config == cpu.config
    assert np.array_equal(cpu.codes, host.codes), f"{np.count_nonzero(cpu.codes != host.codes)} record bytes differ"
    assert np.array_equal(bits_of(cpu.scales), bits_of(host.scales))
    assert (cpu.sinks is None) == (host.sinks is None)
    if cpu.sinks is not None:
        assert np.array_equal(bits_of(cpu.sinks), bits_of(host.sinks))
    y = cpu_codec.decode(cpu)
    assert np.array_equal(bits_of(y), bits_of(torch_to_numpy(tri_codec.decode(gpu))))
    assert np.array_equal(bits_of(y), bits_of(torch_to_numpy(tri_codec.decode(to_device(cpu, device)))))
    assert np.array_equal(bits_of(y), bits_of(cpu_codec.decode(host)))
    return y


def keys_like(shape, seed=0, dtype=np.float32):
    """Key-like data: every channel its own offset and spread (some nearly flat)."""
    rng = np.random.default_rng(seed)
    D = shape[-1]
    return (rng.standard_normal(shape) * rng.uniform(0.01, 4, D) + rng.uniform(-3, 3, D)).astype(dtype)


def plan_config(scheme="kvcx3", layer_bits=((2, 4, 4), (5, 4, 3), (7, 3, 2))):
    base = KVConfig.from_scheme(scheme)
    return KVConfig(key=base.key, value=base.value, scheme=scheme, layer_bits=layer_bits, variants=base.variants)


def seal(tensors, meta):
    """A hand-crafted file: the edit is made consistently, CRC recomputed (only the schema stands guard)."""
    return {**meta, "kvcx.crc32": crc32(tensors, meta)}


runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def codec_roundtrip(codec, x, key=None):
    buf = np.empty(codec.serialized_size(x.shape, x.dtype), np.uint8)
    assert codec.encode_into(x, buf, key=key) == buf.size
    y = np.empty_like(x)
    codec.decode_into(buf, y, key=key)
    return buf, y


def small_chunk(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, 3, 64, 128)) * 2).astype(BFLOAT16)


def reseal(buf):
    from kvcx.formats.chunk import checksum

    b = buf.copy()
    b[52:56] = np.frombuffer(struct.pack("<I", checksum(b)), np.uint8)
    return b


def packed_store(kv, K, V, chunks):
    """A PackedKV (kvcx.cache.store) from chunks of K/V [B, H, T, D] (the first chunk encoded with ``kv``'s
    codecs, sinks and all, the others without sinks), and the decoded K/V the materialising path would see."""
    from kvcx.cache.store import PackedKV
    from kvcx.codecs import decode

    B, H, _, D = K.shape
    store = PackedKV(B * H, D, kv.key, kv.value)
    nxt = [c.replace(sinks=0) for c in (kv.key, kv.value)]
    Kd, Vd = np.empty_like(K), np.empty_like(V)
    o = 0
    for i, n in enumerate(chunks):
        ck, cv = (kv.key, kv.value) if i == 0 else nxt
        pk = ck.encode(np.ascontiguousarray(K[:, :, o:o + n]))
        pv = cv.encode(np.ascontiguousarray(V[:, :, o:o + n]))
        store.append(pk, pv)
        Kd[:, :, o:o + n], Vd[:, :, o:o + n] = decode(pk), decode(pv)
        o += n
    return store, Kd[:, :, :o], Vd[:, :, :o]


def kv_states(rng, B, H, T, D):
    """(keys, values) float32 [B, H, T, D]: keys with per-channel offsets (what makes per-channel grouping pay),
    values plain."""
    K = (rng.standard_normal((B, H, T, D)) * 2 + rng.standard_normal((1, 1, 1, D)) * 3).astype(np.float32)
    V = rng.standard_normal((B, H, T, D)).astype(np.float32)
    return K, V


def without_sinks(kv):
    """``kv`` (a KVConfig) with no exact sink tokens (what a sliding window's layer packs)."""
    return KVConfig(key=kv.key.replace(sinks=0), value=kv.value.replace(sinks=0), scheme=kv.scheme)
