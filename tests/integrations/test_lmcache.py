"""kvcx as an LMCache serde, through LMCache's own machinery on the CPU: the serializer pair on a real
KV chunk of the embedded model, LMCache's factory and AsyncSerdeProcessor, SerdeL2AdapterWrapper over a
real L1 manager with the FS adapter and with the RESP adapter against a real Valkey server, and two
processes sharing that server as two engines would."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcx.codecs import KVConfig
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import FormatError, KvcxError
from kvcx.formats.packed import compress_tensors, decompress_tensors

from helpers import codec_roundtrip, reseal, small_chunk

if os.environ.get("CI"):  # CI installs the extra: these tests must run there, never skip
    import lmcache  # noqa: F401
    import torch
else:
    pytest.importorskip("lmcache")
    torch = pytest.importorskip("torch")

import kvcx.integrations.lmcache_local as ls  # noqa: E402
from kvcx.formats.chunk import ChunkCodec, read_header  # noqa: E402

HERE = Path(__file__).resolve().parent


TOKENS = 256


@pytest.fixture(scope="module")
def chunks(loaded, wikitext_path):
    """Two real KV chunks of the embedded model (256 tokens x 30 layers, BF16, KV_2LTD)."""
    model, tok, _ = loaded
    ids = tok(wikitext_path.read_text(encoding="utf-8")[:20000])["input_ids"][:2 * TOKENS]
    with torch.inference_mode():
        cache = model(torch.tensor(ids)[None], use_cache=True).past_key_values
    out = []
    for c in range(2):
        sl = slice(c * TOKENS, (c + 1) * TOKENS)
        kv = [torch.stack([layer.keys[0, :, sl], layer.values[0, :, sl]]) for layer in cache.layers]  # [2, H, T, D]
        x = torch.stack(kv, dim=1).permute(0, 1, 3, 2, 4)  # [2, L, T, H, D]
        x = x.reshape(2, len(kv), TOKENS, -1).contiguous().bfloat16()
        out.append(ls.to_numpy(x).copy())
    assert out[0].shape == (2, 30, TOKENS, 192)
    return out



@pytest.mark.model
def test_serializer_pair_equals_kvcx_compress(chunks):
    from kvcx.integrations.lmcache import KvcxDeserializer, KvcxSerializer

    x = chunks[0]
    ser, de = KvcxSerializer(), KvcxDeserializer()
    lay = ls.layout(x.shape)
    n = ser.estimate_serialized_size(lay)
    dst = np.zeros(n, np.uint8)
    assert ser.serialize(ls.memobj(x), ls.memobj(dst), ls.key(0)) == n  # the estimate is exact
    y = np.zeros_like(x)
    de.deserialize(ls.memobj(dst), ls.memobj(y), ls.key(0))
    # kvcx compress on the same tensors, in the file layout [1, kv_heads, tokens, head_dim]
    L, H = x.shape[1], x.shape[3] // 64
    tensors = {f"layer_{l}_{kind}": np.ascontiguousarray(x[i, l].reshape(TOKENS, H, 64).transpose(1, 0, 2))[None]
               for l in range(L) for i, kind in enumerate(("key", "value"))}
    out, meta, _ = compress_tensors(tensors, KVConfig.from_scheme())
    dec = decompress_tensors(out, meta)
    want = np.stack([np.stack([dec[f"layer_{l}_{kind}"][0].transpose(1, 0, 2).reshape(TOKENS, H * 64)
                               for l in range(L)]) for kind in ("key", "value")])
    assert np.array_equal(y.view(np.uint16), want.view(np.uint16))  # the same error, bit for bit
    packed = sum(a.nbytes for a in out.values())
    assert n - 64 - 8 * 4 * L <= packed <= n  # the same payload, plus the chunk header and padding
    ratio = x.nbytes / n
    assert 3.5 <= ratio < 3.7, ratio  # vs BF16
    err = y.astype(np.float32) - x.astype(np.float32)
    assert 10 * np.log10((x.astype(np.float32) ** 2).sum() / (err ** 2).sum()) > 20


@pytest.mark.model
def test_the_triton_kernels_write_and_read_the_cpu_chunk(chunks):
    """The serde on the Triton backend (as a chunk on a GPU takes; here Triton's interpreter on the CPU when
    there is none): the same wire bytes as the CPU kernels, and each side decodes the other's chunk bit for bit.
    A slice of a real chunk (4 layers x 64 tokens): the interpreter is slow."""
    from kvcx.integrations.lmcache import KvcxDeserializer, KvcxSerializer, chunk_codec_from_options

    x = np.ascontiguousarray(chunks[0][:, :4, :64])
    tri = chunk_codec_from_options({"backend": "triton"})[0]
    n = KvcxSerializer().estimate_serialized_size(ls.layout(x.shape))
    on_cpu, on_gpu = np.zeros(n, np.uint8), np.full(n, 0xAB, np.uint8)
    assert KvcxSerializer().serialize(ls.memobj(x), ls.memobj(on_cpu), ls.key(3)) == n
    assert KvcxSerializer(tri).serialize(ls.memobj(x), ls.memobj(on_gpu), ls.key(3)) == n
    assert np.array_equal(on_cpu, on_gpu)
    y_cpu, y_gpu = np.zeros_like(x), np.zeros_like(x)
    KvcxDeserializer().deserialize(ls.memobj(on_gpu), ls.memobj(y_cpu), ls.key(3))
    KvcxDeserializer(tri).deserialize(ls.memobj(on_cpu), ls.memobj(y_gpu), ls.key(3))
    assert np.array_equal(y_cpu.view(np.uint16), y_gpu.view(np.uint16))
    assert float(np.abs(y_cpu.astype(np.float32) - x.astype(np.float32)).max()) < 0.5 * float(np.abs(x.astype(np.float32)).max())
    damaged = on_gpu.copy()
    damaged[200] ^= 1
    with pytest.raises(FormatError, match="CRC"):
        KvcxDeserializer(tri).deserialize(ls.memobj(damaged), ls.memobj(y_gpu), ls.key(3))


@pytest.mark.model
def test_factory_and_async_processor(chunks):
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types

    import kvcx.integrations.lmcache as kl

    assert kl.register() == "kvcx" and kl.register() == "kvcx"  # idempotent
    assert "kvcx" in get_registered_serde_types()
    proc = create_serde_processor(SerdeConfig("kvcx", {"scheme": "kvcx", "group_size": 64, "head_dim": 64,
                                                       "threads": 2, "max_workers": 2}))
    try:
        want = [codec_roundtrip(ChunkCodec(), c, key=kl.key_bytes(ls.key(i))) for i, c in enumerate(chunks)]
        n = proc.estimate_serialized_size(ls.layout(chunks[0].shape))
        dsts = [np.zeros(n, np.uint8) for _ in chunks]
        tid = proc.submit_serialize([ls.memobj(c) for c in chunks], [ls.memobj(d) for d in dsts],
                                    [ls.key(i) for i in range(len(chunks))])
        assert ls.wait(lambda: proc.query_serialize_result(tid)) is True
        for d, (buf, _) in zip(dsts, want):
            assert np.array_equal(d, buf)
        outs = [np.zeros_like(c) for c in chunks]
        tid = proc.submit_deserialize([ls.memobj(d) for d in dsts], [ls.memobj(o) for o in outs],
                                      [ls.key(i) for i in range(len(chunks))])
        assert ls.wait(lambda: proc.query_deserialize_result(tid)) is True
        for o, (_, y) in zip(outs, want):
            assert np.array_equal(o.view(np.uint16), y.view(np.uint16))
        # a damaged payload fails the task (LMCache then reports a miss), it never yields other data
        dsts[0][1000] ^= 0x10
        tid = proc.submit_deserialize([ls.memobj(dsts[0])], [ls.memobj(outs[0])], [ls.key(0)])
        assert ls.wait(lambda: proc.query_deserialize_result(tid)) is False
    finally:
        proc.close()


def _store_lookup_load(l1, w, chunks):
    """Store chunks through the wrapper, look them up, load them: each exact to the codec's output."""
    keys = [ls.key(i) for i in range(len(chunks))]
    ok, nbytes = ls.store(l1, w, keys, chunks)
    assert ok and nbytes == ChunkCodec().serialized_size(chunks[0].shape, BFLOAT16) * len(chunks)
    assert ls.lookup(w, keys, ls.layout(chunks[0].shape)) == len(keys)
    w.submit_unlock(keys)
    hits, got = ls.load(w, keys, chunks[0].shape)
    assert hits == len(keys)
    for g, c in zip(got, chunks):
        assert np.array_equal(g.view(np.uint16), codec_roundtrip(ChunkCodec(), c)[1].view(np.uint16))
    return keys


@pytest.mark.model
def test_serde_wrapper_with_fs_adapter(chunks, tmp_path):
    l1 = ls.make_l1()
    w = ls.make_wrapper(l1, "fs", base_path=tmp_path)
    try:
        keys = _store_lookup_load(l1, w, chunks)
        n = ChunkCodec().serialized_size(chunks[0].shape, BFLOAT16)
        files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
        assert len(files) == len(chunks) and all(f.stat().st_size == n for f in files)
        assert read_header(np.fromfile(files[0], np.uint8))["layers"] == 30
        # a file damaged on disk is refused: the load misses, nothing is decoded from it
        raw = bytearray(files[0].read_bytes())
        raw[5000] ^= 1
        files[0].write_bytes(bytes(raw))
        hits, _ = ls.load(w, keys[:1], chunks[0].shape)
        assert hits == 0
    finally:
        w.close()
        l1.close()


def _fused_chunks(n=3, bs=128):
    """vLLM CPU fused-plane chunks [layers, 256 tokens, 3 heads * 2 * 64] (BF16) and their keys and values."""
    from kvcx.formats.layouts import VllmCpu

    lay, out = VllmCpu(bs, "vec"), []
    for i in range(n):
        kv = ls.chunk_for(i, (2, 4, 256, 192))
        x = np.zeros((4, 256, 384), BFLOAT16)
        lay.join([kv[0].copy(), kv[1].copy()], x, lay.geometry(x.shape, 64, "chunk"))
        out.append(x)
    return out


def test_fused_planes_through_the_fs_adapter(tmp_path):
    """vLLM's CPU chunks through LMCache's serde wrapper and FS adapter: stored as kvcx chunks that record their
    layout, loaded back into the fused layout; a serde configured for another block size sees a miss."""
    from kvcx.formats.layouts import VllmCpu

    chunks, keys = _fused_chunks(), [ls.key(i) for i in range(3)]
    serde = ("kvcx", {"head_dim": 64, "layout": "vllm_cpu", "block_size": 128, "isa": "vec"})
    codec = ChunkCodec(plane_layout=VllmCpu(128, "vec"))
    l1 = ls.make_l1()
    w = ls.make_wrapper(l1, "fs", serde=serde, base_path=tmp_path / "a")
    try:
        ok, nbytes = ls.store(l1, w, keys, chunks)
        assert ok and nbytes == codec.serialized_size(chunks[0].shape, BFLOAT16) * 3
        files = sorted(p for p in (tmp_path / "a").rglob("*") if p.is_file())
        assert len(files) == 3 and all(read_header(np.fromfile(f, np.uint8))["layout"] == VllmCpu(128, "vec")
                                       for f in files)
        hits, got = ls.load(w, keys, chunks[0].shape)
        assert hits == 3
        for g, c in zip(got, chunks):
            assert np.array_equal(g.view(np.uint16), codec_roundtrip(codec, c)[1].view(np.uint16))
    finally:
        w.close()
    other = ls.make_wrapper(l1, "fs", serde=("kvcx", {**serde[1], "block_size": 64}), base_path=tmp_path / "a")
    try:   # the same files read as another block size's chunks: a miss, never a permuted cache
        assert ls.load(other, keys, chunks[0].shape)[0] == 0
    finally:
        other.close()
        l1.close()


@pytest.mark.parametrize("options,message", [
    ({"head_dim": 64}, "set the serde option layout to 'vllm_cpu'"),
    ({"head_dim": 64, "layout": "vllm_cpu", "block_size": 96}, "not a whole number of the engine's 96-token blocks"),
    ({"head_dim": 128, "layout": "vllm_cpu", "block_size": 128}, "set head_dim to the model's head size"),
])
def test_a_chunk_the_config_cannot_place_is_never_stored(tmp_path, options, message):
    """A single-plane chunk without a layout, a block size that does not divide the chunk, a head size that does
    not divide the plane: the store fails with kvcx's message (LMCache logs it), and nothing is written."""
    chunks, keys = _fused_chunks(1), [ls.key(0)]
    l1 = ls.make_l1()
    w = ls.make_wrapper(l1, "fs", serde=("kvcx", options), base_path=tmp_path)
    try:
        with pytest.raises(KvcxError, match=message):
            ls.store(l1, w, keys, chunks)
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    finally:
        w.close()
        l1.close()


@pytest.fixture
def valkey():
    proc, port = ls.start_valkey()
    try:
        yield port
    finally:
        ls.stop(proc)
    assert proc.poll() is not None


@pytest.mark.model
def test_serde_wrapper_with_resp_adapter(chunks, valkey):
    l1 = ls.make_l1()
    w = ls.make_wrapper(l1, "resp", port=valkey)
    try:
        _store_lookup_load(l1, w, chunks)
    finally:
        w.close()
        l1.close()


@pytest.mark.model
def test_two_processes_share_a_real_server(chunks, valkey, tmp_path):
    """Engine A stores through LMCache into Valkey; engine B, a fresh process, loads the same tensors."""
    src = tmp_path / "chunks.npy"
    np.save(src, np.stack(chunks).view(np.int16))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}

    def run(mode):
        p = subprocess.run([sys.executable, "-m", "kvcx.integrations.lmcache_local", mode, str(valkey), str(src),
                            str(tmp_path / "out.npy")], capture_output=True, text=True, env=env, timeout=180)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    assert "STORED True" in run("store")
    out = run("load")
    assert f"LOADED {len(chunks)} {len(chunks)}" in out, out
    got = np.load(tmp_path / "out.npy").view(BFLOAT16)
    for g, c in zip(got, chunks):
        assert np.array_equal(g.view(np.uint16), codec_roundtrip(ChunkCodec(), c)[1].view(np.uint16))


def test_foreign_and_damaged_payloads():
    from kvcx.integrations.lmcache import KvcxDeserializer

    x = small_chunk()
    buf, want = codec_roundtrip(ChunkCodec(), x)
    de = KvcxDeserializer()
    out = np.zeros_like(x)
    fp8 = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    cases = {
        "an fp8 serde's payload": fp8.reshape(-1).copy(),
        "empty": np.zeros(0, np.uint8),
        "truncated header": buf[:40].copy(),
        "truncated payload": buf[:-9].copy(),
        "random bytes": np.random.default_rng(1).integers(0, 256, buf.size, dtype=np.uint8),
    }
    other = np.zeros((2, 3, 32, 128), BFLOAT16)
    cases["another shape"] = codec_roundtrip(ChunkCodec(), other)[0]
    wrong_version = buf.copy()
    wrong_version[4] = 9
    cases["another wire version"] = wrong_version
    for label, payload in cases.items():
        with pytest.raises(FormatError):
            de.deserialize(ls.memobj(payload), ls.memobj(out), ls.key(0))
    # every bit of a real payload flipped: an error each time (CRC-32), never other data
    for pos in range(0, buf.size, 7):
        b = buf.copy()
        b[pos] ^= 1 << (pos % 8)
        with pytest.raises(FormatError):
            ChunkCodec().decode_into(b, out)
    # a header edited consistently (CRC recomputed) to nonsense settings: refused, not decoded
    for off, value in ((9, 1), (28, 7), (32, 12), (40, 3), (56, 1)):
        b = buf.copy()
        b[off] = value
        with pytest.raises(FormatError):
            ChunkCodec().decode_into(reseal(b), out)
    ChunkCodec().decode_into(buf, out)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("options,message", [
    ({"scheme": "nf4"}, "scheme"),
    ({"group_size": 48}, "group size 48"),
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": "64"}, "head_dim"),
    ({"threads": 0}, "threads"),
    ({"rotate": "yes"}, "rotate"),
    ({"bits": 5}, "bits 5"),
    ({"unknown": 1}, "unknown kvcx serde options"),
    ({"max_workers": 0}, "max_workers"),
    ({"backend": "gpu"}, "backend 'gpu' is not supported"),
])
def test_bad_options(options, message):
    from kvcx.integrations.lmcache import KvcxSerdeError, create_serde

    with pytest.raises(KvcxSerdeError, match=message):
        create_serde(options)
    assert issubclass(KvcxSerdeError, KvcxError) and issubclass(KvcxSerdeError, ValueError)


def test_the_launcher_checks_every_store_node_at_start(valkey):
    """``kvcx lmcache-server``'s checks before LMCache starts: a Valkey adapter's nodes (a cluster's seeds) and a
    RESP adapter's server must answer; one that does not is a red error naming it (exit 1, no traceback), as is a
    node that is not host:port. A node that answers passes."""
    from kvcx.integrations.engine_local import free_port, valkey_cluster_adapter
    from kvcx.integrations.lmcache import check_server_args, store_nodes

    up, down = valkey, free_port()
    assert store_nodes(valkey_cluster_adapter(f"127.0.0.1:{up}, 10.0.0.2:7001")) == [("127.0.0.1", up),
                                                                                     ("10.0.0.2", 7001)]
    assert check_server_args(["--l2-adapter", json.dumps(valkey_cluster_adapter(f"127.0.0.1:{up}"))]) == 0
    bad = json.dumps(valkey_cluster_adapter(f"127.0.0.1:{up},127.0.0.1:{down}", {"type": "kvcx"}))
    with pytest.raises(KvcxError, match=rf"#2 \(valkey\): store node 127.0.0.1:{down} does not answer"):
        check_server_args(["--l2-adapter", json.dumps({"type": "fs", "base_path": "/tmp"}), "--l2-adapter", bad])
    with pytest.raises(KvcxError, match=r"#1 \(resp\): store node 127.0.0.1:\d+ does not answer"):
        check_server_args([f"--l2-adapter={json.dumps({'type': 'resp', 'host': '127.0.0.1', 'port': down})}"])
    for nodes in ("127.0.0.1", "", "h:0", "h:x"):
        with pytest.raises(KvcxError, match="#1 \\(valkey\\): (startup node|startup_nodes)"):
            check_server_args(["--l2-adapter", json.dumps({"type": "valkey", "startup_nodes": nodes})])
    r = subprocess.run([sys.executable, "-m", "kvcx", "lmcache-server", "--port", str(free_port()), "--l2-adapter", bad],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"127.0.0.1:{down} does not answer" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_chunk_shape_errors():
    from kvcx.integrations.lmcache import KvcxSerializer

    ser = KvcxSerializer(ChunkCodec(head_dim=64))
    with pytest.raises(KvcxError, match="not a multiple of head_dim 64"):
        ser.estimate_serialized_size(ls.layout((2, 3, 16, 100)))
    with pytest.raises(KvcxError, match="which its shape cannot tell: set the serde option layout"):
        ser.estimate_serialized_size(ls.layout((3, 16, 128)))
    with pytest.raises(KvcxError, match="KV_2LTD"):
        ser.estimate_serialized_size(ls.layout((3, 16)))
    with pytest.raises(KvcxError, match="bfloat16, float16 or float32"):
        ser.estimate_serialized_size(ls.layout((2, 3, 16, 128), torch.int8))


def test_module_is_only_imported_when_asked():
    code = "import sys, kvcx, kvcx.api, kvcx.cli; assert 'lmcache' not in sys.modules and 'kvcx.integrations.lmcache' " \
           "not in sys.modules; print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvcx'))))"
    p = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "kvcx.integrations.lmcache" not in json.loads(p.stdout)
