"""The file API: compress / decompress / metrics on files, sidecars, outputs checked before any work."""
import json
import os

import numpy as np
import pytest
import safetensors.numpy as hf

import kvcx.formats.atomic as fileio
from kvcx.api import compress_kv_cache, decompress_kv_cache, get_compression_metrics
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import FormatError, KvcxError
from kvcx.formats import safetensors as kst

from helpers import random_array, run, small_cache, tinyllama_cache


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


def test_sidecar_blocked_fails_before_work_and_keeps_the_good_output(small_cache_file, tmp_path):
    good = tmp_path / "good.safetensors"
    compress_kv_cache(small_cache_file, good)
    before = good.read_bytes(), (tmp_path / "good.safetensors.metadata.json").read_bytes()
    (tmp_path / "good.safetensors.metadata.json").unlink()
    (tmp_path / "good.safetensors.metadata.json").mkdir()
    r = run("compress", small_cache_file, good)
    assert r.exit_code == 1 and "is a directory" in r.output, r.output
    assert good.read_bytes() == before[0]
    assert not list(tmp_path.glob(".kvcx-*"))


def test_stale_sidecar_is_removed_with_the_new_output(tmp_path):
    src = tmp_path / "in.safetensors"
    kst.save_file(small_cache(), src)  # no sidecar
    out = tmp_path / "out.safetensors"
    (tmp_path / "out.safetensors.metadata.json").write_text('{"model_name": "stale"}')
    compress_kv_cache(src, out)
    assert not (tmp_path / "out.safetensors.metadata.json").exists()


@pytest.mark.parametrize("cmd", ["compress", "decompress"])
def test_no_output_is_an_input(small_cache_file, tmp_path, cmd):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(small_cache_file, packed)
    src = small_cache_file if cmd == "compress" else packed
    side = f"{src}.metadata.json"
    before = {p: open(p, "rb").read() for p in (src, side)}
    (tmp_path / "link.safetensors").symlink_to(src)
    os.link(src, tmp_path / "hard.safetensors")
    for out in (side, tmp_path / "link.safetensors", tmp_path / "hard.safetensors",
                tmp_path / "sub" / ".." / src.name, str(src)[:-len(".safetensors")] + "x/../" + src.name):
        (tmp_path / "in.safetensorsx").mkdir(exist_ok=True)
        (tmp_path / "p.safetensorsx").mkdir(exist_ok=True)
        (tmp_path / "sub").mkdir(exist_ok=True)
        r = run(cmd, src, out)
        assert r.exit_code == 1 and "output is" in r.output and "input file" in r.output, (out, r.output)
    # the output's sidecar would be the input: `decompress r.safetensors.metadata.json r.safetensors`
    odd = tmp_path / "r.safetensors.metadata.json"
    os.link(packed, odd)
    r = run("decompress", odd, tmp_path / "r.safetensors")
    assert r.exit_code == 1 and "output is" in r.output, r.output
    assert odd.read_bytes() == packed.read_bytes()
    for p, b in before.items():
        assert open(p, "rb").read() == b


def test_unwritable_output_directory_names_the_output(small_cache_file, tmp_path, monkeypatch):
    real_open = os.open

    def denied(path, flags, mode=0o777, **kw):
        if ".kvcx-" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(fileio.os, "open", denied)
    r = run("compress", small_cache_file, tmp_path / "o.safetensors")
    assert r.exit_code == 1 and "o.safetensors: cannot write in" in r.output and ".kvcx-" not in r.output, r.output


def test_surprises_are_warnings_and_check_makes_them_exit_3(tmp_path):
    """What a user would not expect is said, one line each (CompressionMetrics.warnings, yellow on the CLI):
    tensors named neither key nor value, a plan made for another model's layers, a file larger per value than
    FP16; a clean cache raises none, and --check makes any of them exit 3 (the file is still written)."""
    rng = np.random.default_rng(0)
    clean = tmp_path / "clean.safetensors"
    kst.save_file(tinyllama_cache(seq=256), clean)
    assert get_compression_metrics(clean).warnings == []
    odd = tmp_path / "odd.safetensors"
    kst.save_file({"foo": rng.standard_normal((1, 2, 256, 64)).astype(np.float16),
                   "layer_0_key": rng.standard_normal((1, 2, 256, 64)).astype(np.float16)}, odd)
    (w,) = get_compression_metrics(odd).warnings
    assert w.startswith("1 tensor(s) (foo) name neither key nor value: compressed with the value codec")
    tiny = tmp_path / "tiny.safetensors"
    kst.save_file(tinyllama_cache(seq=2), tiny)
    (w,) = get_compression_metrics(tiny).warnings
    assert "more than FP16's 16" in w and float(w.split(" holds ")[1].split(" bits")[0]) > 16
    from kvcx.api import load_plan

    plan = load_plan("smollm2-kvcx2-2.54")     # SmolLM2's 30 layers: widths set in 18, 20 and 23; this cache has 22
    assert {L for L, _, _ in plan.layer_bits} == {18, 20, 23}
    (w,) = get_compression_metrics(clean, config=plan).warnings
    assert w.startswith("the plan sets layers 23, which the cache (layers 0-21) does not hold")
    r = run("compress", odd, tmp_path / "odd.kvcx.safetensors", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["warnings"] == [w0 for w0 in get_compression_metrics(odd).warnings]
    r = run("compress", odd, tmp_path / "odd2.kvcx.safetensors", "--check", "--max-rmse", "10")
    assert r.exit_code == 3 and "name neither key nor value" in r.output
    assert (tmp_path / "odd2.kvcx.safetensors").exists()
    r = run("compress", clean, tmp_path / "clean.kvcx.safetensors", "--check", "--max-rmse", "10")
    assert r.exit_code == 0 and "Warning" not in r.output
    ints = tmp_path / "ints.safetensors"
    kst.save_file({"ids": np.arange(10, dtype=np.int32)}, ints)
    r = run("compress", ints, tmp_path / "ints.kvcx.safetensors")
    assert r.exit_code == 0 and "no float tensors: nothing was compressed, its 1 tensor(s) are stored as they are" \
        in r.output and "misses the reference design's thresholds" not in r.output
