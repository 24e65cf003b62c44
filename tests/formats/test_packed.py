"""The packed safetensors variant: golden files byte for byte, versions, layouts, presets and plans in files."""
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as hf
from safetensors import safe_open

from kvcx.api import compress_kv_cache, decompress_kv_cache
from kvcx.codecs import KVConfig
from kvcx.codecs.metrics import error_stats
from kvcx.errors import CodecError, FormatError
from kvcx.formats import safetensors as kst
from kvcx.formats.packed import compress_tensors, decompress_tensors, packed_tensors

from helpers import keys_like, plan_config, random_array, run, tinyllama_cache

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


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
    from kvcx.formats.packed import crc32

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


@pytest.mark.parametrize("scheme,bits", [("kvcx3", 3), ("kvcx2", 2)])
def test_presets_roundtrip_through_the_file_format(scheme, bits):
    cfg = KVConfig.from_scheme(scheme)
    assert cfg.key.bits == bits and cfg.value.bits == bits and cfg.key.sinks == cfg.value.sinks == 1
    assert cfg.value.rotate
    tensors = tinyllama_cache(seq=128)
    packed, meta, _ = compress_tensors(tensors, cfg)
    blob = kst.save(packed, meta)
    loaded, loaded_meta = kst.load_with_metadata(blob)
    out = decompress_tensors(loaded, loaded_meta)
    n = sum(a.size for a in tensors.values())
    bpv = 8.0 * sum(a.nbytes for a in packed.values()) / n
    # codes + scales + zero points (+ the FP16 sink token of 128): nominal bits plus the sinks' share
    assert cfg.bits_per_value(22) <= bpv <= cfg.bits_per_value(22) + 16 / 128 + 1e-9
    for name, a in tensors.items():
        assert out[name].shape == a.shape and out[name].dtype == a.dtype
        s = error_stats(a, out[name])
        assert s.snr_db > (10.0 if bits == 3 else 5.0), (name, s.snr_db)
        np.testing.assert_array_equal(out[name][..., :1, :], a[..., :1, :])   # the sink token is exact


def test_layer_bits_give_each_layer_its_width():
    cfg = plan_config()
    tensors = tinyllama_cache(seq=128)
    packed, meta, _ = compress_tensors(tensors, cfg)
    info = json.loads(meta["kvcx.tensors"])
    codecs = json.loads(meta["kvcx.codecs"])
    assert info["layer_2_key"]["codec"] == "key.b4" and info["layer_2_value"]["codec"] == "value.b4"
    assert info["layer_5_value"]["codec"] == "value" and info["layer_7_value"]["codec"] == "value.b2"
    assert info["layer_0_key"]["codec"] == "key" and codecs["key.b4"]["bits"] == 4
    recs = packed_tensors(packed, meta)
    assert recs["layer_2_key"].config["bits"] == 4 and recs["layer_0_key"].config["bits"] == 3
    # a 4-bit layer holds 4/3 the code bytes of a 3-bit one
    assert packed["layer_2_key.kvcx.codes"].size * 3 == packed["layer_0_key.kvcx.codes"].size * 4
    out = decompress_tensors(packed, meta)
    err = {n: error_stats(tensors[n], out[n]).snr_db for n in ("layer_2_key", "layer_0_key", "layer_7_value",
                                                              "layer_0_value")}
    assert err["layer_2_key"] > err["layer_0_key"] + 3 and err["layer_7_value"] < err["layer_0_value"] - 3
    # the same tensors under the uniform preset decode to the same values where the widths agree
    base = decompress_tensors(*compress_tensors(tensors, KVConfig.from_scheme("kvcx3"))[:2])
    np.testing.assert_array_equal(base["layer_0_key"], out["layer_0_key"])
    # named variants: keys in groups of 128 tokens, asymmetric 3-bit values; their own codec names
    var = plan_config(layer_bits=((9, "b3g128", "b3a"), (10, "b4g128", 4)))
    packed, meta, _ = compress_tensors(tensors, var)
    info, codecs = json.loads(meta["kvcx.tensors"]), json.loads(meta["kvcx.codecs"])
    assert info["layer_9_key"]["codec"] == "key.b3g128" and info["layer_9_value"]["codec"] == "value.b3a"
    assert info["layer_10_key"]["codec"] == "key.b4g128" and info["layer_10_value"]["codec"] == "value.b4"
    assert codecs["key.b3g128"]["group_size"] == 128 and codecs["value.b3a"]["scheme"] == "asymmetric"
    assert codecs["value.b4"]["scheme"] == "symmetric" and codecs["value.b3a"]["sinks"] == 1
    # g128 keys: half the scale and zero-point bytes of g64 keys, the same code bytes
    assert packed["layer_9_key.kvcx.scales"].size * 2 == packed["layer_0_key.kvcx.scales"].size
    assert packed["layer_9_key.kvcx.codes"].size == packed["layer_0_key.kvcx.codes"].size
    out = decompress_tensors(*kst.load_with_metadata(kst.save(packed, meta)))
    for n in ("layer_9_key", "layer_9_value", "layer_10_key"):
        np.testing.assert_array_equal(out[n][..., :1, :], tensors[n][..., :1, :])   # the sink stays exact
    sym, asym = (error_stats(tensors[n], out[n]).snr_db for n in ("layer_0_value", "layer_9_value"))
    assert asym > sym + 1, (asym, sym)   # asymmetric 3-bit values: one more level used, a better SNR


def test_kvcx2w_preset_and_weights_round_trip_through_the_file_format(tmp_path):
    from kvcx.codecs import WidthCodec
    from kvcx.errors import FormatError
    from kvcx.formats.packed import read_settings

    cfg = KVConfig.from_scheme("kvcx2w")
    assert isinstance(cfg.key, WidthCodec) and (cfg.key.bits, cfg.key.group_size, cfg.key.sinks) == (2.0, 32, 1)
    assert cfg.value == KVConfig.from_scheme("kvcx2").value
    assert cfg.bits_per_value(22) == 2.5
    tensors = {k: keys_like(a.shape, seed=i) if k.endswith("key") else a
               for i, (k, a) in enumerate(tinyllama_cache(seq=512).items())}
    weights = {str(L): (np.random.default_rng(L).uniform(0, 5, (4, 64))).tolist() for L in range(22)}
    wcfg = KVConfig.from_config({**cfg.get_config(), "key_weights": weights})
    assert KVConfig.from_config(wcfg.get_config()) == wcfg and "query-weighted" in wcfg.describe()
    for c in (cfg, wcfg):
        packed, meta, _ = compress_tensors(tensors, c)
        assert meta["kvcx.format_version"] == "3"
        out = decompress_tensors(*kst.load_with_metadata(kst.save(packed, meta)))
        for name, a in tensors.items():
            assert out[name].dtype == a.dtype and out[name].shape == a.shape
            assert error_stats(a, out[name]).snr_db > (9 if name.endswith("key") else 6), name
        bpv = 8.0 * sum(a.nbytes for a in packed.values()) / sum(a.size for a in tensors.values())
        assert 2.5 < bpv < 2.6, bpv   # 2.5 nominal + sinks, channel ranges and widths of 512 tokens
    # the weights choose the widths: the weighted file differs in its key codes only
    p1, _, _ = compress_tensors(tensors, cfg)
    p2, _, _ = compress_tensors(tensors, wcfg)
    assert not np.array_equal(p1["layer_3_key.kvcx.codes"], p2["layer_3_key.kvcx.codes"])
    assert np.array_equal(p1["layer_3_value.kvcx.codes"], p2["layer_3_value.kvcx.codes"])
    # the CLI takes the preset; a version-2 file that names the widths codec is refused
    src = tmp_path / "c.safetensors"
    kst.save_file(tensors, src)
    r = run("compress", str(src), str(tmp_path / "p.safetensors"), "--scheme", "kvcx2w")
    assert r.exit_code == 0, r.output
    r = run("decompress", str(tmp_path / "p.safetensors"), str(tmp_path / "d.safetensors"))
    assert r.exit_code == 0, r.output
    packed, meta, _ = compress_tensors(tensors, cfg)
    meta = {**meta, "kvcx.format_version": "2"}
    with pytest.raises(FormatError, match="needs format version 3"):
        read_settings(meta, "old.safetensors")
    # settings that do not go together
    with pytest.raises(CodecError, match="sets its own bits"):
        KVConfig.from_scheme("kvcx2w", bits=3)
    with pytest.raises(CodecError, match="key_weights.*widths key codec"):
        KVConfig.from_config({**KVConfig.from_scheme("kvcx2").get_config(), "key_weights": weights})
    with pytest.raises(CodecError, match="layer 1 must list"):
        KVConfig.from_config({**cfg.get_config(), "key_weights": {"1": [[1.0, -2.0]]}})
    with pytest.raises(CodecError, match="per-layer selections of widths keys alone"):
        KVConfig(key=cfg.key, value=cfg.value, layer_bits=[(0, 4, 4)])
    from kvcx.formats.chunk import ChunkCodec

    with pytest.raises(CodecError, match="kvcx2w.*not supported"):
        ChunkCodec(cfg)


def test_an_mla_layers_rope_key_is_packed_as_value_rope():
    """An MLA model's cache as a file (a latent of 64 and a RoPE key of 32 a layer): with latent_layers the RoPE key
    is written with its own codec (value.rope: a width per channel at 8 bits), any reader decodes it from the file's
    own codecs, and its error is an 8-bit one; without them, the scheme's 4-bit values."""
    from kvcx.codecs.kvconfig import ROPE_NAME

    rng = np.random.default_rng(0)
    tensors = {}
    for L in range(2):
        tensors[f"layer_{L}_key"] = rng.standard_normal((1, 1, 200, 64)).astype(np.float16)
        tensors[f"layer_{L}_value"] = (rng.standard_normal((1, 1, 200, 32)) * np.linspace(0.1, 4, 32)).astype(np.float16)
    base = KVConfig.from_scheme()
    cfg = base.with_latent_layers([1])
    packed, meta, _ = compress_tensors(tensors, cfg)
    info, codecs = json.loads(meta["kvcx.tensors"]), json.loads(meta["kvcx.codecs"])
    assert info["layer_1_value"]["codec"] == ROPE_NAME and info["layer_0_value"]["codec"] == "value"
    assert info["layer_1_key"]["codec"] == "key" and codecs[ROPE_NAME] == cfg.rope_key_codec().get_config()
    out = decompress_tensors(*kst.load_with_metadata(kst.save(packed, meta)))
    plain = decompress_tensors(*compress_tensors(tensors, base)[:2])
    np.testing.assert_array_equal(out["layer_1_key"], plain["layer_1_key"])   # the latent: the keys' codec
    np.testing.assert_array_equal(out["layer_0_value"], plain["layer_0_value"])
    eight, four = (error_stats(tensors["layer_1_value"], o["layer_1_value"]).snr_db for o in (out, plain))
    assert eight > four + 15, (eight, four)
