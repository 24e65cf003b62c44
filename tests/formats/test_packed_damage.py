"""Damaged, crafted and fuzzed packed files: a clear FormatError or the right data, never a crash."""
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvcx.api import compress_kv_cache, decompress_kv_cache
from kvcx.codecs import IntCodec, KVConfig, Packed
from kvcx.errors import CodecError, FormatError, KvcxError
from kvcx.formats import safetensors as kst
from kvcx.formats.packed import compress_tensors, crc32, decompress_tensors, original_metadata

from helpers import random_array, run, seal, small_cache


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
    from hypothesis import given, settings
    from hypothesis import strategies as st

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


def _with_shape(path, out, shape):
    """A hand-edited packed file: layer_0_key recorded with ``shape`` and empty parts (CRC recomputed)."""
    tensors, meta = kst.load_with_metadata(path.read_bytes())
    tensors = dict(tensors)
    info = json.loads(meta["kvcx.tensors"])
    info["layer_0_key"]["shape"] = shape
    n = 1
    for s in shape[:-2]:
        n *= s
    tensors["layer_0_key.kvcx.codes"] = np.zeros(0, np.uint8)
    tensors["layer_0_key.kvcx.scales"] = np.zeros((n, 0, 0), np.float16)
    tensors["layer_0_key.kvcx.zeros"] = np.zeros((n, 0, 0), np.float16)
    tensors["layer_0_key.kvcx.sinks"] = np.zeros((*shape[:-2], 1, shape[-1]), np.float16)
    meta = {**meta, "kvcx.tensors": json.dumps(info)}
    kst.save_file(tensors, out, {**meta, "kvcx.crc32": crc32(tensors, meta)})
    return out


def test_zero_width_channel_tensor_is_an_error_not_sigfpe(small_cache_file, tmp_path):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(small_cache_file, packed)
    bad = _with_shape(packed, tmp_path / "bad.safetensors", [1, 2, 8, 0])
    code = textwrap.dedent(f"""
        from kvcx.api import decompress_kv_cache
        from kvcx.errors import KvcxError
        try:
            decompress_kv_cache({str(bad)!r}, {str(tmp_path / 'o.safetensors')!r})
        except KvcxError as e:
            print('KvcxError:', e)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)  # SIGFPE would be -8 / 136
    assert "KvcxError:" in p.stdout and "shape" in p.stdout, p.stdout
    r = run("decompress", bad, tmp_path / "o.safetensors")
    assert r.exit_code == 1 and "Traceback" not in r.output
    pytest.importorskip("torch")
    from kvcx.quality.bridge import load_kv_cache

    with pytest.raises(KvcxError):
        load_kv_cache(bad)
    # the codec itself, handed such a record
    with pytest.raises(CodecError, match="empty"):
        IntCodec(axis="channel", scheme="asymmetric").decode(Packed(
            codes=np.zeros(0, np.uint8), scales=np.zeros((2, 0, 0), np.float16), zeros=np.zeros((2, 0, 0), np.float16),
            sinks=None, shape=(1, 2, 8, 0), dtype="F16", config=IntCodec(axis="channel", scheme="asymmetric")
            .get_config()))


@pytest.mark.parametrize("shape", [[1, 2, 0, 16], [0, 2, 8, 16], [1, -2, 8, 16], [1, 2, 8, 2 ** 62],
                                   [2 ** 40, 2 ** 40, 8, 16], [1, 2, 8.5, 16], [1, True, 8, 16], "8", [[8]]])
def test_bad_recorded_shapes(small_cache_file, tmp_path, shape):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(small_cache_file, packed)
    tensors, meta = kst.load_with_metadata(packed.read_bytes())
    info = json.loads(meta["kvcx.tensors"])
    info["layer_0_key"]["shape"] = shape
    with pytest.raises(FormatError, match="layer_0_key|CRC"):  # as edited, and as hand-crafted (CRC resealed)
        decompress_tensors(tensors, {**meta, "kvcx.tensors": json.dumps(info)})
    with pytest.raises(FormatError, match="layer_0_key"):
        decompress_tensors(tensors, seal(tensors, {**meta, "kvcx.tensors": json.dumps(info)}))


def _packed(lz4=False):
    out, meta, _ = compress_tensors(small_cache(), KVConfig.from_scheme(group_size=16), lz4=lz4,
                                 source_metadata={"origin": "test"}, sidecar={"model_name": "m", "layers": [1, 2]})
    return dict(out), dict(meta)


def _edit(meta, key, fn):
    value = json.loads(meta[key])
    fn(value)
    return {**meta, key: json.dumps(value)}


def _crafted():
    t, m = _packed()
    yield "an edit without the CRC", t, {**m, "kvcx.passthrough": "[]"}, "CRC-32"
    yield "rotate as a string", t, _edit(m, "kvcx.codecs", lambda c: c["value"].update(rotate="false")), "rotate"
    yield "float shape", t, _edit(m, "kvcx.tensors", lambda i: i["layer_0_key"].update(shape=[1, 2, 8.9, 16])), "shape"
    yield "config as pairs", t, {**m, "kvcx.config": json.dumps([["scheme", "kvcx"], ["lz4", False]])}, "kvcx.config"
    dup = m["kvcx.tensors"][:-1] + ',"layer_0_key":' + json.dumps(json.loads(m["kvcx.tensors"])["layer_0_key"]) + "}"
    yield "duplicate tensor key", t, {**m, "kvcx.tensors": dup}, "duplicate key"
    yield "missing passthrough entry", t, {**m, "kvcx.passthrough": "[]"}, "not accounted for"
    t2 = dict(t)
    t2["x.kvcx.codes"] = t2.pop("positions")
    yield "codes listed as pass-through", t2, {**m, "kvcx.passthrough": '["x.kvcx.codes"]'}, "reserved suffix"
    yield "negative shape", t, _edit(m, "kvcx.tensors", lambda i: i["layer_0_key"].update(shape=[1, -2, 8, 16])), \
        "shape"
    yield "overflowing shape", t, _edit(m, "kvcx.tensors", lambda i: i["layer_0_key"].update(
        shape=[2 ** 63, 2 ** 63, 8, 16])), "shape"
    yield "non-list passthrough", t, {**m, "kvcx.passthrough": '"positions"'}, "passthrough"
    yield "invalid source metadata", t, {**m, "kvcx.source_metadata": "{nope"}, "source_metadata"
    yield "invalid sidecar", t, {**m, "kvcx.sidecar": "[1,"}, "sidecar"
    deep = "[" * 100000 + "]" * 100000
    for key in ("kvcx.tensors", "kvcx.source_metadata", "kvcx.sidecar", "kvcx.codecs"):
        yield f"deep {key}", t, {**m, key: deep}, "nests"
    yield "sinks 2**70", t, _edit(m, "kvcx.codecs", lambda c: c["key"].update(sinks=2 ** 70)), "sinks"
    yield "unknown metadata key", t, {**m, "kvcx.extra": "1"}, "unknown __metadata__ keys"
    yield "extra stored tensor", {**t, "ghost": np.zeros(1, np.float32)}, m, "not accounted for"
    t3 = dict(t)
    t3["layer_0_key.kvcx.scales"] = np.full_like(t3["layer_0_key.kvcx.scales"], np.inf)
    yield "infinite scales", t3, m, "NaN/Inf"
    t4 = dict(t)
    t4["layer_0_key.kvcx.scales"] = t4["layer_0_key.kvcx.scales"].reshape(-1)
    yield "scales of the wrong shape", t4, m, "shape"


@pytest.mark.parametrize("label,tensors,meta,message", list(_crafted()), ids=[c[0] for c in _crafted()])
def test_crafted_metadata(label, tensors, meta, message):
    if label != "an edit without the CRC":
        meta = seal(tensors, meta)
    with pytest.raises(FormatError, match=message):
        decompress_tensors(tensors, meta)
        original_metadata(meta)


def test_lz4_frames_are_checksummed_and_bounded():
    pytest.importorskip("lz4")
    import lz4.frame

    t, m = _packed(lz4=True)
    frame = t["layer_0_value.kvcx.codes"].tobytes()
    assert frame[4] & 0x04  # content checksum flag
    # a frame that promises far more than the metadata: refused without allocating it
    huge = np.frombuffer(lz4.frame.compress(bytes(100 << 20), content_checksum=True), np.uint8)
    t2 = {**t, "layer_0_value.kvcx.codes": huge}
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(FormatError, match="does not decompress to"):
        decompress_tensors(t2, seal(t2, m))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 << 20, peak
    # every bit flip inside a frame is caught (CRC recomputed: only the frame's own checksum stands guard)
    caught = 0
    for pos in range(7, len(frame)):
        for bit in range(8):
            b = bytearray(frame)
            b[pos] ^= 1 << bit
            t3 = {**t, "layer_0_value.kvcx.codes": np.frombuffer(bytes(b), np.uint8)}
            with pytest.raises(FormatError):
                decompress_tensors(t3, seal(t3, m))
            caught += 1
    assert caught == 8 * (len(frame) - 7)


_BAD_VALUES = [None, True, False, 0, -1, 1.5, 2 ** 70, "", "x", [], {}, [[[[]]]], {"a": {"b": {}}}]


def _variants(value):
    """Mutations of a JSON value by type, value and nesting, at every path inside it."""
    for bad in _BAD_VALUES:
        yield bad
    yield [value]
    yield {"x": value}
    if isinstance(value, dict):
        for k in list(value):
            for v in _variants(value[k]):
                yield {**value, k: v}
            yield {kk: vv for kk, vv in value.items() if kk != k}
        yield {**value, "unexpected": 1}
    elif isinstance(value, list) and value:
        for i in range(len(value)):
            for v in _variants(value[i]):
                yield value[:i] + [v] + value[i + 1:]
        yield value + value[:1]
        yield value[1:]


def _decompress(tensors, meta):
    out = decompress_tensors(tensors, meta)
    return out, original_metadata(meta)


def _same(a, b):
    (ta, ma), (tb, mb) = a, b
    return set(ta) == set(tb) and all(ta[k].dtype == tb[k].dtype and np.array_equal(ta[k], tb[k]) for k in ta) \
        and ma == mb


@pytest.mark.parametrize("lz4", [False, True])
def test_fuzz_whole_decompress_path(lz4):
    if lz4:
        pytest.importorskip("lz4")
    t, m = _packed(lz4=lz4)
    want = _decompress(t, m)
    start, tried = time.perf_counter(), 0
    for key in list(m):
        raw_variants = ["", "{", "null", "[]", "{}", "1", "[" * 5000 + "]" * 5000, m[key] + "x"]
        try:
            parsed = json.loads(m[key])
            raw_variants += [json.dumps(v) for v in _variants(parsed)]
        except ValueError:
            pass
        metas = [{k: v for k, v in m.items() if k != key}] + [{**m, key: rv} for rv in raw_variants]
        for mm in metas:
            tried += 1
            try:
                got = _decompress(t, mm)
            except KvcxError:
                continue
            assert _same(got, want), (key, mm[key] if key in mm else "<deleted>")
    # every bit of every stored tensor
    for name in t:
        raw = bytearray(np.ascontiguousarray(t[name]).reshape(-1).view(np.uint8).tobytes())
        for pos in range(len(raw)):
            for bit in range(8):
                raw[pos] ^= 1 << bit
                arr = np.frombuffer(bytes(raw), dtype=t[name].dtype).reshape(t[name].shape)
                raw[pos] ^= 1 << bit
                tried += 1
                try:
                    got = _decompress({**t, name: arr}, m)
                except KvcxError:
                    continue
                raise AssertionError(f"a flipped bit in {name} decoded without an error")
    assert tried > 5000 and time.perf_counter() - start < 60, (tried, time.perf_counter() - start)


@pytest.mark.parametrize("scheme", ["reference", "asymmetric", "kivi", "kvcx"])
def test_fp16_extremes_stay_finite(tmp_path, scheme):
    x = random_array((1, 2, 64, 64), np.float32, seed=3)
    x = (x / np.abs(x).max() * 65504).astype(np.float16)
    x[0, 0, 5, :] = 65504
    x[0, 1, 7, :] = -65504
    t = {"layer_0_key": x, "layer_0_value": x.copy()}
    src, out, back = tmp_path / "x.safetensors", tmp_path / "p.safetensors", tmp_path / "r.safetensors"
    kst.save_file(t, src)
    try:
        compress_kv_cache(src, out, scheme=scheme)
    except CodecError as exc:  # a rotation can push a group past FP16 scales: an error, never inf
        assert "too large for FP16 scales" in str(exc) and scheme == "kvcx"
        return
    decompress_kv_cache(out, back)
    for k, v in kst.load_file(back).items():
        assert np.isfinite(v.astype(np.float32)).all(), k
        assert np.abs(v.astype(np.float32) - t[k].astype(np.float32)).max() <= 65504 / 7
