"""Never write what kvcx cannot read back, never decode what no encoder writes (hardening, second round):
every encoder path through the file format, tokens <= sinks included; text that is not valid Unicode;
crafted records whose checksum is right but whose parameters no encoder writes."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import codec_roundtrip, seal, small_chunk
from kvcx.codecs import IntCodec, KVConfig, WidthCodec, get_codec, registered_codecs
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import CodecError, FormatError
from kvcx.formats import safetensors as kst
from kvcx.formats.chunk import ChunkCodec
from kvcx.formats.packed import compress_tensors, decompress_tensors

SCHEMES = ["reference", "kvcx", "kivi", "kvcx3", "kvcx2", "kvcx2w", "kvcx4w", "kvcx2v", "symmetric", "asymmetric"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheme=st.sampled_from(SCHEMES), tokens=st.integers(1, 70), heads=st.integers(1, 3),
       head_dim=st.sampled_from([8, 16, 24, 64, 80]), sinks=st.integers(0, 72), dtype=st.sampled_from(["F16", "F32", "BF16"]),
       seed=st.integers(0, 1000))
def test_every_encoder_output_reads_back(scheme, tokens, heads, head_dim, sinks, dtype, seed):
    """Every preset, any token count (fewer tokens than sinks included), head dims the codecs take and those they
    hand to the fallback: the packed file reads back with the right shapes, sinks exact, values finite."""
    np_dtype = {"F16": np.float16, "F32": np.float32, "BF16": BFLOAT16}[dtype]
    rng = np.random.default_rng(seed)
    t = {f"layer_0_{kind}": rng.standard_normal((1, heads, tokens, head_dim)).astype(np_dtype)
         for kind in ("key", "value")}
    cfg = KVConfig.from_scheme(scheme, sinks=None if scheme == "reference" else sinks)
    out, meta, _ = compress_tensors(t, cfg)
    back = decompress_tensors(*kst.load_with_metadata(kst.save(out, meta)))
    for name, a in t.items():
        assert back[name].shape == a.shape and back[name].dtype == a.dtype
        assert np.isfinite(back[name].astype(np.float32)).all()
        s = 0 if scheme == "reference" else min(sinks, tokens)
        if s and json.loads(meta["kvcx.tensors"])[name]["codec"] != "fallback":
            np.testing.assert_array_equal(back[name][..., :s, :].view(np.uint8), a[..., :s, :].view(np.uint8))


@pytest.mark.parametrize("codec_id", [c for c in registered_codecs() if "sinks" in get_codec({"id": c}).settings])
def test_every_registered_codec_decodes_a_tensor_of_sinks_only(codec_id):
    codec = get_codec({"id": codec_id, "sinks": 8})
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(np.float32)   # 5 tokens, 8 sinks
    p = codec.encode(x)
    np.testing.assert_array_equal(codec.decode(p), x)


def test_widths_of_a_chunk_of_sinks_only_sum_to_the_budget():
    """Every token a sink: the kvcx2w encoder stores widths its decoder accepts (no zero widths), summing to the
    budget."""
    c = WidthCodec(bits=2.0, group_size=32, sinks=64)
    p = c.encode(np.ones((1, 3, 64, 64), np.float32))
    widths = p.codes[:3 * 64].reshape(3, 64)
    assert (widths.sum(axis=1) == 128).all() and widths.max() <= 8
    np.testing.assert_array_equal(c.decode(p), np.ones((1, 3, 64, 64), np.float32))


def test_text_that_cannot_be_written_back_is_refused(tmp_path):
    x = np.ones((1, 1, 4, 8), np.float32)
    for bad in ({"layer_\ud800_key": x}, ):
        with pytest.raises(FormatError, match="lone surrogate"):
            compress_tensors(bad, KVConfig.from_scheme())
        with pytest.raises(FormatError, match="lone surrogate"):
            kst.save(bad)
    with pytest.raises(FormatError, match="lone surrogate"):
        compress_tensors({"k": x}, KVConfig.from_scheme(), source_metadata={"note": "a\udc80"})
    with pytest.raises(FormatError, match="lone surrogate"):
        compress_tensors({"k": x}, KVConfig.from_scheme(), sidecar={"model_name": {"x": ["\ud800"]}})
    # a file whose header holds one (legal JSON, not valid Unicode) is refused when read, as is such a sidecar
    good = kst.save({"k": x}, {"note": "ok"})
    n = int.from_bytes(good[:8], "little")
    header = good[8:8 + n].decode().replace('"ok"', '"\\ud800"')
    header += " " * (n - len(header))
    with pytest.raises(FormatError, match="lone surrogate"):
        kst.load(good[:8] + header.encode() + good[8 + n:])
    src = tmp_path / "c.safetensors"
    kst.save_file({"layer_0_key": np.ones((1, 1, 8, 16), np.float16)}, src)
    (tmp_path / "c.safetensors.metadata.json").write_text('{"model_name": "\\ud800"}')
    from kvcx.api import compress_kv_cache

    with pytest.raises(FormatError, match="metadata sidecar.*lone surrogate"):
        compress_kv_cache(src, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# 7. crafted but checksum-valid: parameters no encoder writes
# ---------------------------------------------------------------------------------------------

def _crafted_files():
    x = np.random.default_rng(1).standard_normal((1, 2, 70, 64)).astype(np.float16)
    t = {"layer_0_key": x, "layer_0_value": x.copy()}
    out, meta, _ = compress_tensors(t, KVConfig.from_scheme("kvcx"))
    for part, value, what in (("layer_0_key.kvcx.sinks", np.inf, "sinks +inf"),
                              ("layer_0_value.kvcx.sinks", np.nan, "sinks NaN"),
                              ("layer_0_value.kvcx.scales", -1.0, "a negative scale"),
                              ("layer_0_key.kvcx.zeros", np.nan, "a NaN zero point"),
                              ("layer_0_key.kvcx.scales", np.inf, "an infinite scale")):
        t2 = {k: np.array(v) for k, v in out.items()}
        t2[part].reshape(-1)[3] = value
        yield what, t2, seal(t2, meta)
    w, wmeta, _ = compress_tensors(t, KVConfig.from_scheme("kvcx2w"))
    t3 = {k: np.array(v) for k, v in w.items()}
    t3["layer_0_key.kvcx.sinks"].reshape(-1)[0] = np.nan
    yield "widths codec sinks NaN", t3, seal(t3, wmeta)


@pytest.mark.parametrize("what,tensors,meta", list(_crafted_files()), ids=[c[0] for c in _crafted_files()])
def test_crafted_checksum_valid_parameters_are_refused(what, tensors, meta):
    with pytest.raises(FormatError, match="NaN/Inf|negative|damaged"):
        decompress_tensors(tensors, meta)


def test_crafted_chunk_parameters_are_refused():
    from helpers import reseal

    x = small_chunk(5)
    codec = ChunkCodec(KVConfig.from_scheme("kvcx"), head_dim=64)
    buf, _ = codec_roundtrip(codec, x)
    secs = codec._kinds(codec.geometry(x.shape, "BF16"), 2)
    out = np.empty_like(x)
    for sec in secs:
        if sec.sinks:   # an infinite sink token, CRC recomputed
            b = buf.copy()
            b[sec.sinks[0]:sec.sinks[0] + 2] = np.frombuffer(np.array([np.inf], BFLOAT16).tobytes(), np.uint8)
            with pytest.raises(FormatError, match="sink tokens hold NaN/Inf"):
                codec.decode_into(reseal(b), out)
        b = buf.copy()   # a negative scale
        b[sec.scales[0]:sec.scales[0] + 2] = np.frombuffer(np.array([-1.0], np.float16).tobytes(), np.uint8)
        with pytest.raises(FormatError, match="negative"):
            codec.decode_into(reseal(b), out)
    with pytest.raises(CodecError, match="negative scales"):
        c = IntCodec()
        p = c.encode(np.ones((2, 64), np.float32))
        p.scales[...] = -1
        c.decode(p)
