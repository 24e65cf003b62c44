"""Keys coded before RoPE (kvcx.codecs.rope, KVConfig(key_rope=...), docs/FORMAT.md 2.9): the frame change against
transformers' own rotary embedding, the packed file that records it, and every bad input."""

import json

import numpy as np
import pytest

from kvcx.codecs import KVConfig, KeyRope
from kvcx.errors import CodecError, FormatError, KvcxError
from kvcx.formats import safetensors as st
from kvcx.formats.packed import compress_tensors, decompress_tensors

FREQ = tuple(float(v) for v in 100000.0 ** (-np.arange(0, 64, 2) / 64))   # SmolLM2's: theta 1e5, head_dim 64


def _hf_rope(k_pre, offset):
    """Keys before RoPE turned by transformers' own Llama rotary embedding and ``apply_rotary_pos_emb``."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64 * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      rope_theta=100000.0, max_position_embeddings=1 << 16)
    rot = LlamaRotaryEmbedding(config=cfg)
    x = torch.from_numpy(k_pre)
    pos = torch.arange(offset, offset + k_pre.shape[-2])[None]
    cos, sin = rot(x, pos)
    _, k = apply_rotary_pos_emb(x, x, cos, sin)
    return k.numpy(), tuple(float(v) for v in rot.inv_freq.double().numpy())


@pytest.mark.parametrize("offset", [0, 5000])
def test_to_frame_undoes_transformers_rope(offset):
    """A key turned by transformers' rotary embedding comes back to its frame before RoPE (to FP32 rounding of
    the model's own angles), and from_frame turns it forward again exactly as the model did."""
    rng = np.random.default_rng(1)
    k_pre = rng.standard_normal((1, 2, 300, 64)).astype(np.float32)
    k_post, freq = _hf_rope(k_pre, offset)
    r = KeyRope(freq, offset)
    np.testing.assert_allclose(r.to_frame(k_post), k_pre, atol=4e-3 if offset else 1e-4)
    np.testing.assert_allclose(r.from_frame(k_pre), k_post, atol=4e-3 if offset else 1e-4)
    # the two directions undo each other to the dtype's rounding, FP16 too
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 4e-3)):
        x = k_post.astype(dtype)
        y = r.from_frame(r.to_frame(x))
        assert y.dtype == dtype and y.shape == x.shape
        np.testing.assert_allclose(y.astype(np.float32), x.astype(np.float32), atol=tol * 4)
    # token t sits at position offset + t: a slice turned from its own offset is the whole tensor's slice
    np.testing.assert_allclose(r.at(offset + 100).to_frame(k_post[..., 100:, :]), r.to_frame(k_post)[..., 100:, :],
                               atol=1e-5)
    # position 0 is not turned at all (a sink at the first token stays exact)
    assert np.array_equal(KeyRope(freq).to_frame(k_post)[..., 0, :], k_post[..., 0, :])


def test_partial_rotary_dims_pass_through():
    """Frequencies for fewer dims than the head (partial rotary): the other dims are not touched."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 50, 40)).astype(np.float32)
    r = KeyRope(FREQ[:8], 3)
    y = r.to_frame(x)
    assert np.array_equal(y[..., 16:], x[..., 16:]) and not np.allclose(y[..., :16], x[..., :16])
    np.testing.assert_allclose(r.from_frame(y), x, atol=1e-5)


def test_keys_before_rope_in_a_packed_file():
    """The file records the frame (version 8, kvcx.key_rope) and the keys it turned; the reader turns them back.
    Keys still before RoPE (channels that hold their value while RoPE turns them) code far better so."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal((1, 3, 1, 64)) * np.linspace(0.5, 4, 64)
    k_pre = (base + 0.1 * rng.standard_normal((1, 3, 512, 64))).astype(np.float32)
    k_post = KeyRope(FREQ).from_frame(k_pre)
    v = rng.standard_normal((1, 3, 512, 64)).astype(np.float32)
    tensors = {"layer_0_key": k_post, "layer_0_value": v}
    plain = KVConfig.from_scheme("kvcx2v")
    turned = plain.with_key_rope(KeyRope(FREQ))
    out, meta, chosen = compress_tensors(tensors, turned)
    assert meta["kvcx.format_version"] == "8"
    rec = json.loads(meta["kvcx.key_rope"])
    assert rec["tensors"] == ["layer_0_key"] and rec["offset"] == 0 and rec["inv_freq"] == list(FREQ)
    blob = st.save(out, meta)
    dec = decompress_tensors(*st.load_with_metadata(blob))
    assert np.array_equal(dec["layer_0_key"], chosen["layer_0_key"].decoded("layer_0_key"))
    p_out, p_meta, _ = compress_tensors(tensors, plain)
    assert p_meta["kvcx.format_version"] == "7" and "kvcx.key_rope" not in p_meta
    plain_dec = decompress_tensors(*st.load_with_metadata(st.save(p_out, p_meta)))
    assert np.array_equal(dec["layer_0_value"], plain_dec["layer_0_value"])   # values untouched
    err = np.mean((dec["layer_0_key"] - k_post) ** 2)
    assert err < 0.25 * np.mean((plain_dec["layer_0_key"] - k_post) ** 2)
    # a damaged record is refused by name, never decoded in the wrong frame
    for bad, what in (({**rec, "tensors": ["layer_9_key"]}, "not a packed tensor"),
                      ({**rec, "inv_freq": [float("nan")] + rec["inv_freq"][1:]}, "inv_freq"),
                      ({**rec, "tensors": []}, "non-empty list of tensors"),
                      ({**rec, "inv_freq": rec["inv_freq"] * 2}, "turns 128 dims")):
        m2 = {**meta, "kvcx.key_rope": json.dumps(bad)}
        from kvcx.formats.packed import crc32
        m2["kvcx.crc32"] = crc32(out, {k: v for k, v in m2.items() if k != "kvcx.crc32"})
        with pytest.raises(FormatError, match=what):
            decompress_tensors(out, m2, source="cache.kvcx")
    m7 = {**meta, "kvcx.format_version": "7"}
    from kvcx.formats.packed import crc32
    m7["kvcx.crc32"] = crc32(out, {k: v for k, v in m7.items() if k != "kvcx.crc32"})
    with pytest.raises(FormatError, match="needs format version 8"):
        decompress_tensors(out, m7, source="cache.kvcx")


def test_key_rope_in_a_config_and_its_bad_input():
    cfg = KVConfig.from_scheme("kvcx2v").with_key_rope(KeyRope(FREQ, 7))
    assert KVConfig.from_config(json.loads(json.dumps(cfg.get_config()))) == cfg
    assert "keys coded before RoPE" in cfg.describe()
    model = KVConfig.from_scheme("kvcx2v").with_key_rope("model")
    assert KVConfig.from_config(model.get_config()).key_rope == "model"
    # the per-layer, thread and guard variants keep the frame
    assert cfg.with_threads(1).key_rope == cfg.key_rope and cfg.guarded([3]).key_rope == cfg.key_rope
    assert cfg.guarded([3]).for_layer(3).key_rope == cfg.key_rope
    with pytest.raises(CodecError, match="which only a loaded model knows"):
        compress_tensors({"layer_0_key": np.ones((1, 1, 64, 64), np.float32)}, model)
    for bad, what in (("pre", "key_rope must be None"), ({"inv_freq": []}, "inv_freq must be 1 to"),
                      ({"inv_freq": [1.0, -1.0]}, "inv_freq must be"), ({"inv_freq": [1.0], "offset": -1}, "offset"),
                      ({"inv_freq": [1.0], "theta": 1e4}, "must be an object with inv_freq")):
        with pytest.raises(CodecError, match=what):
            KVConfig.from_config({**KVConfig.from_scheme("kvcx2v").get_config(), "key_rope": bad})
    with pytest.raises(CodecError, match="tensor 'layer_0_key' of shape \\[1, 1, 8, 32\\].*64 rotary dims"):
        compress_tensors({"layer_0_key": np.ones((1, 1, 8, 32), np.float32)}, cfg)


def test_kvcx_cache_and_chunks_refuse_keys_before_rope():
    """The fused kernels and LMCache's chunks take keys after RoPE: a config coding them before is refused, naming
    the option and what to do."""
    pytest.importorskip("torch")
    from transformers import LlamaConfig

    from kvcx.cache.kvcx_cache import KvcxCache
    from kvcx.formats.chunk import ChunkCodec

    cfg = KVConfig.from_scheme("kvcx2v").with_key_rope(KeyRope(FREQ))
    with pytest.raises(KvcxError, match="codes keys before RoPE.*with_key_rope\\(None\\)"):
        KvcxCache(LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
                  kv_config=cfg)
    with pytest.raises(CodecError, match="keys coded before RoPE"):
        ChunkCodec(cfg)


def test_compress_with_the_shipped_prerope_plan(tmp_path):
    """`kvcx compress --plan smollm2-kvcx2v-prerope-2.12` writes a version-8 file whose keys `kvcx decompress` turns
    back: the plan carries the model's frequencies, so no model is needed; the metrics count the keys as restored."""
    from helpers import run, tinyllama_cache

    cache128 = tmp_path / "smollm2.safetensors"   # SmolLM2's shape: the plan weighs its 3 KV heads in 30 layers
    st.save_file(tinyllama_cache(seq=128, layers=30, heads=3), cache128)
    out, back = tmp_path / "c.kvcx.safetensors", tmp_path / "back.safetensors"
    r = run("compress", cache128, out, "--plan", "smollm2-kvcx2v-prerope-2.12", "--json")
    assert r.exit_code == 0, r.output
    with st.SafeFile(out) as f:
        assert f.metadata["kvcx.format_version"] == "8"
        turned = json.loads(f.metadata["kvcx.key_rope"])["tensors"]
    assert turned and all(n.endswith("_key") for n in turned)
    assert run("decompress", out, back).exit_code == 0
    # the frame change exactly: the plan's codecs on the keys turned back, then turned forward, as the file holds them
    from kvcx.api import load_plan

    cfg = load_plan("smollm2-kvcx2v-prerope-2.12")
    rope = cfg.key_rope
    with st.SafeFile(cache128) as a, st.SafeFile(back) as b:
        x, y = ({n: np.array(t[n]) for n in t} for t in (a.tensors(), b.tensors()))
    pre = {n: rope.to_frame(x[n], n).astype(x[n].dtype) for n in turned}
    plain = decompress_tensors(*compress_tensors(pre, cfg.with_key_rope(None))[:2])
    for n in turned:
        assert y[n].dtype == x[n].dtype and y[n].shape == x[n].shape
        want = rope.from_frame(plain[n].astype(np.float64), n)
        assert np.max(np.abs(y[n] - want)) <= 2e-3 * np.max(np.abs(want)), n   # FP16 rounding of the output
    rmse = {t["name"]: t["rmse"] for t in json.loads(r.stdout)["tensors"]}
    with st.SafeFile(back) as b, st.SafeFile(cache128) as a:
        n = turned[0]
        want = float(np.sqrt(np.mean((b.tensors()[n].astype(np.float64) - a.tensors()[n]) ** 2)))
    assert rmse[n] == pytest.approx(want, rel=1e-3)
