"""No crash, no lost file, no silently wrong data: crafted files, signals, paths, modes, extreme values."""
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from typer.testing import CliRunner

import kvcx.fileio as fileio
from common import random_array
from kvcx import safetensors_io as kst
from kvcx.api import compress_kv_cache, decompress_kv_cache
from kvcx.cli import app
from kvcx.codec import IntCodec, Packed
from kvcx.errors import CodecError, FormatError, KvcxError
from kvcx.kvconfig import KVConfig, is_key_tensor
from kvcx.packed import compress_tensors, crc32, decompress_tensors, original_metadata

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def small_cache():
    return {"layer_0_key": random_array((1, 2, 8, 16), np.float16, seed=1, outlier_channels=2),
            "layer_0_value": random_array((1, 2, 8, 16), np.float16, seed=2),
            "positions": np.arange(8, dtype=np.int64)}


@pytest.fixture
def cache(tmp_path):
    p = tmp_path / "in.safetensors"
    kst.save_file(small_cache(), p, {"origin": "test"})
    (tmp_path / "in.safetensors.metadata.json").write_text(json.dumps({"model_name": "m", "seq_len": 8}))
    return p


# ---------------------------------------------------------------------------------------------
# 1. the crash: a divisor of 0 (and every other size the kernels trust) is checked in Python first
# ---------------------------------------------------------------------------------------------

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


def test_zero_width_channel_tensor_is_an_error_not_sigfpe(cache, tmp_path):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(cache, packed)
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
    from kvcx.kv_cache import load_kv_cache

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
def test_bad_recorded_shapes(cache, tmp_path, shape):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(cache, packed)
    tensors, meta = kst.load_with_metadata(packed.read_bytes())
    info = json.loads(meta["kvcx.tensors"])
    info["layer_0_key"]["shape"] = shape
    with pytest.raises(FormatError, match="layer_0_key|CRC"):  # as edited, and as hand-crafted (CRC resealed)
        decompress_tensors(tensors, {**meta, "kvcx.tensors": json.dumps(info)})
    with pytest.raises(FormatError, match="layer_0_key"):
        decompress_tensors(tensors, seal(tensors, {**meta, "kvcx.tensors": json.dumps(info)}))


# ---------------------------------------------------------------------------------------------
# 2, 3. outputs committed together; no output is an input
# ---------------------------------------------------------------------------------------------

def test_sidecar_blocked_fails_before_work_and_keeps_the_good_output(cache, tmp_path):
    good = tmp_path / "good.safetensors"
    compress_kv_cache(cache, good)
    before = good.read_bytes(), (tmp_path / "good.safetensors.metadata.json").read_bytes()
    (tmp_path / "good.safetensors.metadata.json").unlink()
    (tmp_path / "good.safetensors.metadata.json").mkdir()
    r = run("compress", cache, good)
    assert r.exit_code == 1 and "is a directory" in r.output, r.output
    assert good.read_bytes() == before[0]
    assert not list(tmp_path.glob(".kvcx-*"))


def test_failure_between_renames_rolls_back(cache, tmp_path, monkeypatch):
    good = tmp_path / "good.safetensors"
    compress_kv_cache(cache, good)
    before = good.read_bytes(), (tmp_path / "good.safetensors.metadata.json").read_bytes()
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(".metadata.json") and ".kvcx-" in str(src) and not str(src).endswith(".bak"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", failing_replace)
    with pytest.raises(FormatError, match="good.safetensors.metadata.json: cannot write .No space left"):
        compress_kv_cache(cache, good, scheme="reference")
    monkeypatch.undo()
    assert good.read_bytes() == before[0]  # the main output was renamed, then rolled back
    assert (tmp_path / "good.safetensors.metadata.json").read_bytes() == before[1]
    assert not list(tmp_path.glob(".kvcx-*"))


def test_stale_sidecar_is_removed_with_the_new_output(tmp_path):
    src = tmp_path / "in.safetensors"
    kst.save_file(small_cache(), src)  # no sidecar
    out = tmp_path / "out.safetensors"
    (tmp_path / "out.safetensors.metadata.json").write_text('{"model_name": "stale"}')
    compress_kv_cache(src, out)
    assert not (tmp_path / "out.safetensors.metadata.json").exists()


@pytest.mark.parametrize("cmd", ["compress", "decompress"])
def test_no_output_is_an_input(cache, tmp_path, cmd):
    packed = tmp_path / "p.safetensors"
    compress_kv_cache(cache, packed)
    src = cache if cmd == "compress" else packed
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


# ---------------------------------------------------------------------------------------------
# 4. signals
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_write_leaves_no_temp_and_the_old_output(tmp_path, sig):
    out = tmp_path / "out.safetensors"
    kst.save_file({"a": np.zeros(4, np.float32)}, out)
    before = out.read_bytes()
    code = textwrap.dedent(f"""
        import sys, time, numpy as np
        import kvcx.fileio as fileio
        from kvcx import safetensors_io as st
        real = fileio.write_bytes_to
        def slow(tmp, target, chunks):
            open(tmp, "wb").write(b"partial")
            print("WRITING", flush=True)
            time.sleep(30)
            real(tmp, target, chunks)
        fileio.write_bytes_to = slow
        st.write_bytes_to = slow
        st.save_file({{"b": np.ones(1 << 20, np.float32)}}, {str(out)!r})
    """)
    def default_signals():  # a runner under nohup or in the background ignores SIGHUP / SIGINT, and kvcx
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # rightly leaves ignored signals ignored
            signal.signal(s, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_signals)
    assert p.stdout.readline().strip() == "WRITING"
    assert list(tmp_path.glob(".kvcx-*.tmp"))  # mid-write: the temporary file exists
    p.send_signal(sig)
    p.wait(timeout=30)
    assert p.returncode in (-sig, 128 + sig, 1), (p.returncode, p.stderr.read())
    assert not list(tmp_path.glob(".kvcx-*")), list(tmp_path.iterdir())
    assert out.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# 5. file modes
# ---------------------------------------------------------------------------------------------

def test_modes_follow_umask_and_existing_files(cache, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "new.safetensors"
        compress_kv_cache(cache, out)
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / "new.safetensors.metadata.json").stat().st_mode) == 0o644
        os.umask(0o027)
        out2 = tmp_path / "new2.safetensors"
        kst.save_file({"a": np.zeros(1, np.float32)}, out2)
        assert stat.S_IMODE(out2.stat().st_mode) == 0o640
        os.chmod(out, 0o664)
        compress_kv_cache(cache, out)  # replacing keeps the existing file's mode
        assert stat.S_IMODE(out.stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_unwritable_output_directory_names_the_output(cache, tmp_path, monkeypatch):
    real_open = os.open

    def denied(path, flags, mode=0o777, **kw):
        if ".kvcx-" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(fileio.os, "open", denied)
    r = run("compress", cache, tmp_path / "o.safetensors")
    assert r.exit_code == 1 and "o.safetensors: cannot write in" in r.output and ".kvcx-" not in r.output, r.output


# ---------------------------------------------------------------------------------------------
# 6. finite in, finite out
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# 7. 0-d tensors and metadata order
# ---------------------------------------------------------------------------------------------

def test_zero_d_tensors_and_metadata_order():
    import safetensors.numpy as hf

    t = {"s": np.array(3.5, np.float32), "i": np.array(7, np.int64)}
    ours = kst.save(t)
    assert ours == hf.save(t)
    back = kst.load(ours)
    assert back["s"].shape == () and back["i"].shape == ()
    meta = {"zeta": "1", "C": "2", "a": "3", "kvcx.x": "4"}
    data = kst.save(t, meta)
    hdr = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert list(hdr["__metadata__"]) == sorted(meta)  # byte order
    theirs = hf.save(t, meta)  # HF 0.8 writes metadata in its hash map's order: same content
    assert json.loads(theirs[8:8 + int.from_bytes(theirs[:8], "little")]) == hdr


# ---------------------------------------------------------------------------------------------
# 8. crafted metadata is read strictly, every stored tensor accounted for
# ---------------------------------------------------------------------------------------------

def seal(tensors, meta):
    """A hand-crafted file: the edit is made consistently, CRC recomputed (only the schema stands guard)."""
    return {**meta, "kvcx.crc32": crc32(tensors, meta)}


def _packed(lz4=False):
    out, meta = compress_tensors(small_cache(), KVConfig.from_scheme(group_size=16), lz4=lz4,
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


# ---------------------------------------------------------------------------------------------
# 9. LZ4: checksummed, bounded
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# the whole decompress path, fuzzed: only a KvcxError or the correct result
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# 10. bad options and shapes: KvcxError children, never a traceback
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--threads", "2147483648"], "n_threads must be a positive integer up to"),
    (["--threads", "10000"], "n_threads must be a positive integer up to"),
    (["--sinks", str(2 ** 70)], "sinks must be a non-negative integer"),
    (["--sinks", "-1"], "sinks must be a non-negative integer"),
    (["--group-size", "3"], "group size 3 is not supported"),
])
def test_bad_option_values_exit_1(cache, tmp_path, args, message):
    for cmd in (["compress", cache, tmp_path / "o.safetensors"], ["metrics", cache]):
        r = run(*cmd, *args)
        assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("shape", [(16,), (2, 8, 16), (1, 1, 2, 8, 16)])
def test_load_kv_cache_rejects_non_4d(tmp_path, shape):
    pytest.importorskip("torch")
    from kvcx.kv_cache import load_kv_cache

    p = tmp_path / "c.safetensors"
    kst.save_file({"layer_0_key": np.zeros(shape, np.float16), "layer_0_value": np.zeros(shape, np.float16)}, p)
    with pytest.raises(KvcxError, match=r"c.safetensors: KV cache tensor 'layer_0_key' has shape"):
        load_kv_cache(p)


def test_kvcx_cache_honours_n_threads_for_every_chunk():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from kvcx.hf import KvcxCache

    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=128)
    for cache in (KvcxCache(cfg, n_threads=1), KvcxCache(cfg, kv_config=KVConfig.from_scheme(), n_threads=1)):
        layer = cache.layers[0]
        assert all(c.n_threads == 1 for c in layer._codecs_next.values())
        assert layer.n_threads == 1
        k = torch.randn(1, 2, 256, 64)
        cache.update(k, k.clone(), 0)
        cache.update(k[:, :, :128], k[:, :, :128].clone(), 0)
        assert len(layer.store) == 2


# ---------------------------------------------------------------------------------------------
# smaller items
# ---------------------------------------------------------------------------------------------

def test_key_and_value_names():
    for name in ("layer_3_key", "k_cache.0", "model.layers.0.self_attn.k_proj", "past_key_values.0.0", "keys"):
        assert is_key_tensor(name), name
    for name in ("layer_3_value", "monkey_value", "past_key_values.0.1", "v_cache.1", "norm_weight", "hockey"):
        assert not is_key_tensor(name), name


def test_errors_do_not_start_with_a_blank_line(cache, tmp_path):
    r = run("compress", cache, tmp_path / "nodir" / "o.safetensors")
    assert r.exit_code == 1 and r.output.startswith("Error: "), repr(r.output)
    assert "o.safetensors: the output directory" in r.output
