"""The packed INT4 safetensors variant and the file-level API."""
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
import safetensors.numpy as hf

from common import random_array
from kvcx import safetensors_io as kst
from kvcx.api import compress_kv_cache, decompress_kv_cache, get_compression_metrics
from kvcx.codec import BFLOAT16
from kvcx.errors import FormatError, KvcxError
from kvcx.kvconfig import KVConfig
from kvcx.packed import compress_tensors, decompress_tensors

GOLDEN = Path(__file__).resolve().parent / "golden"


def tinyllama_cache(seq=128, dtype=np.float16, seed=0, outlier=1.0):
    """22 layers x K, V [1, 4, seq, 64]; `outlier` scales two key channels (real keys have such channels)."""
    rng = np.random.default_rng(seed)
    t = {}
    for i in range(22):
        k = rng.standard_normal((1, 4, seq, 64)).astype(np.float32)
        k[..., [3, 17]] *= outlier
        t[f"layer_{i}_key"] = (0.5 * k).astype(dtype)
        t[f"layer_{i}_value"] = (0.5 * rng.standard_normal((1, 4, seq, 64))).astype(dtype)
    return t


@pytest.fixture
def cache_file(tmp_path):
    p = tmp_path / "cache.safetensors"
    kst.save_file(tinyllama_cache(), p)
    (tmp_path / "cache.safetensors.metadata.json").write_text(json.dumps(
        {"num_layers": 22, "num_kv_heads": 4, "seq_len": 128, "head_dim": 64, "dtype": "float16",
         "model_name": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}))
    return p


@pytest.mark.parametrize("name", ["packed_reference_v2.safetensors", "packed_kvcx_v2.safetensors",
                                  "packed_kvcx_vsink_v2.safetensors",
                                  "packed_reference_v1.safetensors", "packed_kvcx_v1.safetensors"])
def test_golden_packed_bytes(name):
    import sys
    sys.path.insert(0, str(GOLDEN))
    import make_golden

    golden = (GOLDEN / name).read_bytes()
    if name in make_golden.CASES:  # the current version is written byte for byte; older ones still read
        assert make_golden.build(name) == golden, "the packed format changed: bump FORMAT_VERSION and regenerate"
    tensors, meta = kst.load_with_metadata(golden)
    out = decompress_tensors(tensors, meta)
    src = make_golden.golden_tensors()
    assert set(out) == set(src)
    assert np.array_equal(out["positions"], src["positions"])
    for k in ("layer_0_key", "layer_0_value"):
        assert out[k].dtype == np.float16 and out[k].shape == src[k].shape
        assert np.abs(out[k].astype(np.float32) - src[k].astype(np.float32)).max() < 0.35


def test_version_1_files_decode_as_before():
    for scheme in ("reference", "kvcx"):
        v1 = decompress_tensors(*kst.load_with_metadata((GOLDEN / f"packed_{scheme}_v1.safetensors").read_bytes()))
        v2 = decompress_tensors(*kst.load_with_metadata((GOLDEN / f"packed_{scheme}_v2.safetensors").read_bytes()))
        assert set(v1) == set(v2)
        for k in v1:
            assert v1[k].dtype == v2[k].dtype and np.array_equal(v1[k], v2[k])


def test_reference_layout_in_golden_file():
    tensors, meta = kst.load_with_metadata((GOLDEN / "packed_reference_v2.safetensors").read_bytes())
    assert meta["kvcx.format"] == "kvcx.packed" and meta["kvcx.format_version"] == "2"
    from kvcx.packed import crc32

    assert meta["kvcx.crc32"] == crc32(tensors, meta) and len(meta["kvcx.crc32"]) == 8
    assert list(meta) == sorted(meta)  # __metadata__ keys in byte order
    assert json.loads(meta["kvcx.tensors"])["layer_0_key"] == {"codec": "key", "dtype": "F16", "shape": [1, 2, 5, 16]}
    assert json.loads(meta["kvcx.codecs"])["key"] == {"axis": "token", "bits": 4, "group_size": 16, "id": "kvcx.int",
                                                      "rotate": False, "scheme": "symmetric", "sinks": 0}
    assert json.loads(meta["kvcx.config"]) == {"lz4": False, "scheme": "reference", "sparsity": 0.0}
    assert json.loads(meta["kvcx.passthrough"]) == ["positions"]
    codes = tensors["layer_0_key.kvcx.codes"]
    scales = tensors["layer_0_key.kvcx.scales"]
    assert codes.dtype == np.uint8 and codes.shape == (80,)
    assert scales.dtype == np.float16 and scales.shape == (2, 5)
    # first token of head 0: values (i % 13 - 6) / 4, scale = 1.5 / 7 -> fp16
    x = ((np.arange(16) % 13 - 6) / 4).astype(np.float32)
    s = np.float16(1.5 / 7)
    assert scales[0, 0] == s
    q = np.clip(np.rint(x / np.float32(s)), -8, 7).astype(np.int64) + 8
    assert codes[:8].tolist() == [int(q[i] | (q[i + 1] << 4)) for i in range(0, 16, 2)]
    # the worked example of docs/FORMAT.md, byte for byte
    assert int(scales[0, 0].view(np.uint16)) == 0x32DB
    assert codes[:8].tobytes() == bytes.fromhex("2143769 8caed1f32".replace(" ", ""))


def test_huggingface_opens_packed_and_restored_files(cache_file, tmp_path):
    packed = tmp_path / "packed.safetensors"
    restored = tmp_path / "restored.safetensors"
    compress_kv_cache(cache_file, packed, group_size=64)
    decompress_kv_cache(packed, restored)
    with safe_open(str(packed), framework="np") as f:
        keys = set(f.keys())
        assert "layer_0_key.kvcx.codes" in keys and f.metadata()["kvcx.format"] == "kvcx.packed"
        assert f.get_tensor("layer_0_key.kvcx.codes").dtype == np.uint8
    assert set(hf.load_file(str(packed))) == keys
    back = hf.load_file(str(restored))
    orig = kst.load_file(cache_file)
    assert set(back) == set(orig)
    for k in orig:
        assert back[k].shape == orig[k].shape and back[k].dtype == orig[k].dtype


def test_tinyllama_shaped_cache_reference_ratio_and_quality(cache_file, tmp_path):
    m = compress_kv_cache(cache_file, tmp_path / "p.safetensors", group_size=64, scheme="reference")
    assert m.compression_ratio >= 3.7, m.compression_ratio
    assert m.compressed_size_bytes == (tmp_path / "p.safetensors").stat().st_size
    assert m.passed and m.rmse < 0.10 and m.snr_db > 18 and m.cosine_similarity > 0.99, m
    assert m.quality_level in ("EXCELLENT", "GOOD", "ACCEPTABLE")
    assert len(m.tensors) == 44


def test_default_scheme_beats_reference_on_outlier_channels(tmp_path):
    p = tmp_path / "outliers.safetensors"
    kst.save_file(tinyllama_cache(outlier=6.0), p)
    ref = get_compression_metrics(p, scheme="reference")
    m = compress_kv_cache(p, tmp_path / "p.safetensors")
    assert not ref.passed and ref.snr_db < 18  # per-token groups suffer from outlier channels
    assert m.passed, m.violations
    assert m.snr_db > ref.snr_db + 4


@pytest.mark.parametrize("dtype", [np.float16, np.float32, BFLOAT16], ids=["F16", "F32", "BF16"])
@pytest.mark.parametrize("scheme", ["reference", "asymmetric", "kivi", "kvcx"])
def test_roundtrip_restores_names_shapes_dtypes(tmp_path, dtype, scheme):
    t = {"layer_0_key": random_array((1, 3, 70, 64), dtype), "layer_0_value": random_array((1, 3, 70, 64), dtype),
         "step": np.array([7], dtype=np.int32), "empty": np.zeros((0, 4), np.float32)}
    p, r = tmp_path / "p.safetensors", tmp_path / "r.safetensors"
    kst.save_file(t, tmp_path / "in.safetensors", {"origin": "test"})
    compress_kv_cache(tmp_path / "in.safetensors", p, scheme=scheme)
    decompress_kv_cache(p, r)
    back = kst.load_file(r)
    assert kst.read_metadata(r) == {"origin": "test"}
    assert set(back) == set(t)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
    assert np.array_equal(back["step"], t["step"])


def test_sidecar_carried_over(cache_file, tmp_path):
    p, r = tmp_path / "p.safetensors", tmp_path / "r.safetensors"
    compress_kv_cache(cache_file, p)
    decompress_kv_cache(p, r)
    side = json.loads((tmp_path / "r.safetensors.metadata.json").read_text())
    assert side["model_name"] == "TinyLlama/TinyLlama-1.1B-Chat-v1.0" and side["num_layers"] == 22
    assert json.loads((tmp_path / "p.safetensors.metadata.json").read_text()) == side


def test_lz4_and_sparsity_sizes(cache_file, tmp_path):
    plain = compress_kv_cache(cache_file, tmp_path / "a.safetensors", scheme="reference")
    lz = compress_kv_cache(cache_file, tmp_path / "b.safetensors", scheme="reference", lz4=True)
    sp = compress_kv_cache(cache_file, tmp_path / "c.safetensors", scheme="reference", lz4=True, sparsity=0.5)
    assert sp.compressed_size_bytes < lz.compressed_size_bytes  # zeros compress
    assert sp.rmse > plain.rmse
    for name in "abc":  # all stay readable by Hugging Face's library
        assert len(hf.load_file(str(tmp_path / f"{name}.safetensors"))) > 0
    decompress_kv_cache(tmp_path / "c.safetensors", tmp_path / "c2.safetensors")
    a = kst.load_file(tmp_path / "c2.safetensors")["layer_0_value"]
    assert np.mean(a == 0) > 0.3


def test_metrics_match_compress(cache_file, tmp_path):
    m1 = get_compression_metrics(cache_file)
    m2 = compress_kv_cache(cache_file, tmp_path / "p.safetensors")
    assert m1.rmse == m2.rmse and m1.snr_db == m2.snr_db
    assert abs(m1.compressed_size_bytes - m2.compressed_size_bytes) == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_api_errors(cache_file, tmp_path):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(cache_file, packed)
    with pytest.raises(FormatError, match="already a kvcx packed file; `kvcx decompress` it first"):
        compress_kv_cache(packed, tmp_path / "x.safetensors")
    with pytest.raises(FormatError, match="plain safetensors file, not a kvcx packed file"):
        decompress_kv_cache(cache_file, tmp_path / "x.safetensors")
    with pytest.raises(KvcxError, match="output is the input file"):
        compress_kv_cache(cache_file, cache_file)
    with pytest.raises(FormatError, match="no such file"):
        compress_kv_cache(tmp_path / "missing.safetensors", tmp_path / "x.safetensors")
    bad = tmp_path / "bad.safetensors"
    kst.save_file({"layer_0_key": np.array([[1.0, np.nan]], np.float32)}, bad)
    before = packed.read_bytes()
    with pytest.raises(KvcxError, match="tensor 'layer_0_key' contains 1 NaN/Inf"):
        compress_kv_cache(bad, packed)
    assert packed.read_bytes() == before  # a failed run never overwrites a good file


def _mutated_packed_files():
    base = (GOLDEN / "packed_kvcx_v1.safetensors").read_bytes()  # v1: no CRC, the schema checks alone
    tensors, meta = kst.load_with_metadata(base)
    yield {**meta, "kvcx.format_version": "9"}, tensors, "packed format version '9' is not supported"
    yield {**meta, "kvcx.tensors": "{not json"}, tensors, "'kvcx.tensors' is not valid JSON"
    t2 = dict(tensors)
    t2.pop("layer_0_key.kvcx.scales")
    yield meta, t2, "missing its layer_0_key.kvcx.scales entry"
    t3 = dict(tensors)
    t3["layer_0_value.kvcx.codes"] = t3["layer_0_value.kvcx.codes"][:-1]
    yield meta, t3, "has 79 code bytes, metadata says 80"
    info = json.loads(meta["kvcx.tensors"])
    info["layer_0_key"]["shape"] = [1, 2, 6, 16]
    yield {**meta, "kvcx.tensors": json.dumps(info)}, tensors, "tensor .layer_0_key. has 64 code bytes, metadata says 80"
    codecs = json.loads(meta["kvcx.codecs"])
    codecs["key"]["group_size"] = 12
    yield {**meta, "kvcx.codecs": json.dumps(codecs)}, tensors, "group size 12 is not supported"
    info = json.loads(meta["kvcx.tensors"])
    info["layer_0_key"]["codec"] = "query"
    yield {**meta, "kvcx.tensors": json.dumps(info)}, tensors, "metadata for tensor 'layer_0_key' is incomplete"


@pytest.mark.parametrize("meta,tensors,message", list(_mutated_packed_files()))
def test_damaged_packed_files(meta, tensors, message):
    with pytest.raises(KvcxError, match=message):
        decompress_tensors(tensors, meta)


def test_fuzzed_packed_file_never_crashes():
    """Every bit flip of a v2 file: a KvcxError, or exactly the original result (never other data)."""
    from hypothesis import given, settings, strategies as st

    base = (GOLDEN / "packed_kvcx_v2.safetensors").read_bytes()
    want = decompress_tensors(*kst.load_with_metadata(base))

    @settings(max_examples=300, deadline=None)
    @given(pos=st.integers(0, len(base) - 1), bit=st.integers(0, 7))
    def run(pos, bit):
        b = bytearray(base)
        b[pos] ^= 1 << bit
        try:
            got = decompress_tensors(*kst.load_with_metadata(bytes(b)))
        except KvcxError:
            return
        assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want), (pos, bit)

    run()


def test_compress_tensors_reserved_names():
    with pytest.raises(FormatError, match="kvcx-reserved suffix"):
        compress_tensors({"x.kvcx.codes": np.zeros(4, np.float32)}, KVConfig.from_scheme())


def test_fallback_codec_for_tensors_the_kv_codecs_cannot_take(tmp_path):
    t = {"layer_0_key": random_array((1, 2, 64, 64), np.float16),
         "layer_0_value": random_array((1, 2, 64, 64), np.float16),
         "norm_weight": random_array((100,), np.float32),      # 1-D
         "proj_value": random_array((1, 2, 10, 48), np.float16)}  # 48 is not a power of two: no rotation
    src, p, r = tmp_path / "in.safetensors", tmp_path / "p.safetensors", tmp_path / "r.safetensors"
    kst.save_file(t, src)
    m = compress_kv_cache(src, p)
    assert {tm.name: tm.codec for tm in m.tensors} == {"layer_0_key": "key", "layer_0_value": "value",
                                                       "norm_weight": "fallback", "proj_value": "fallback"}
    meta = kst.read_metadata(p)
    assert json.loads(meta["kvcx.codecs"])["fallback"]["rotate"] is False
    decompress_kv_cache(p, r)
    back = kst.load_file(r)
    for k, v in t.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype
