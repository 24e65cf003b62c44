"""vLLM's TurboQuant KV cache against vLLM's own code, which nobody here wrote: its Lloyd-Max centroids
(``centroids.py``) bit for bit, and the records its store kernel (``triton_turboquant_store``, run in Triton's
interpreter) writes into a slot byte for byte, on random and on the embedded model's keys and values.

vLLM's CPU build disables its Triton wrapper (no CPU backend), so the kernel's file is loaded with plain ``triton``
(its two vLLM imports replaced, line for line) and run in the interpreter. The interpreter's float32 -> e4m3 cast is
not the GPU's (it takes 0.4988 to 0.25 where ``cvt.rn.satfinite`` and torch give 0.5), so ``turboquant_k8v4``'s fp8
keys are checked against torch's cast (what the GPU's round-to-nearest-even cast writes) and its values against the
kernel."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcx.api import compress_kv_cache, decompress_kv_cache
from kvcx.codecs import decode, get_codec
from kvcx.codecs.dtypes import BFLOAT16
from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.turboquant import PRESETS, TurboQuantCodec, lloyd_max_centroids
from kvcx.errors import CodecError

VLLM = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])   # the vllm extra: CI installs it


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def vllm_tq(tmp_path_factory):
    """vLLM's centroids, config and store-kernel modules, without importing vllm (seconds, and no CPU backend)."""
    src = (VLLM / "v1/attention/ops/triton_turboquant_store.py").read_text()
    for old, new in (("from vllm.triton_utils import tl, triton", "import triton; import triton.language as tl"),
                     ("from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15",
                      "_use_fp8_e4b15 = lambda index: 0  # Hopper and newer: e4m3 (e4nv)")):
        assert src.count(old) == 1, f"vLLM's store kernel changed its imports: {old!r}"
        src = src.replace(old, new)
    path = tmp_path_factory.mktemp("vllm") / "vllm_tq_store.py"
    path.write_text(src)
    qdir = VLLM / "model_executor/layers/quantization/turboquant"
    return (_load(qdir / "centroids.py", "vllm_tq_centroids"), _load(qdir / "config.py", "vllm_tq_config"),
            _load(path, "vllm_tq_store"))


def to_torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype == BFLOAT16 else torch.from_numpy(a)


def vllm_slots(vllm_tq, scheme, key, value):
    """The slots vLLM's store kernel writes for keys and values [tokens, heads, D] (torch): uint8 [tokens, heads,
    slot], and the rotated unit keys it quantized (float64, for the boundary check)."""
    centroids, config, store = vllm_tq
    tokens, heads, D = key.shape
    cfg = config.TurboQuantConfig.from_cache_dtype(scheme, D)
    c = centroids.get_centroids(D, cfg.centroid_bits)
    s, _ = c.sort()
    H = torch.tensor([[1.0]])
    while H.shape[0] < D:     # vLLM's _build_hadamard (turboquant_attn.py)
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    PiT = H / math.sqrt(D)
    cache = torch.zeros(tokens, 1, heads, cfg.slot_size_aligned, dtype=torch.uint8)
    store.triton_turboquant_store(key, value, cache, torch.arange(tokens, dtype=torch.int32), PiT, (s[:-1] + s[1:]) / 2,
                                  cfg.key_mse_bits, cfg.key_packed_size, cfg.value_quant_bits, cfg.key_fp8)
    k = key.double().reshape(-1, D)
    y = (k / (k.norm(dim=1, keepdim=True) + 1e-8)) @ PiT.double()
    return cache.reshape(tokens, heads, -1).numpy(), y.numpy(), ((s[:-1] + s[1:]) / 2).double().numpy(), cfg


def check_scheme(vllm_tq, scheme, key, value):
    """kvcx's records of keys and values [tokens, heads, D] against vLLM's slots: value records byte for byte; key
    records byte for byte but for indices of coordinates whose rotated value lies within 1e-6 of a midpoint (vLLM
    rotates with a float32 GEMM, kvcx in double): returns how many such indices differed."""
    ref, y, mid, cfg = vllm_slots(vllm_tq, scheme, to_torch(key), to_torch(value))
    kv = KVConfig.from_scheme(scheme)
    heads_first = (1, 0, 2)      # a cache's [heads, tokens, D]
    kp = kv.key.encode(np.ascontiguousarray(key.transpose(heads_first)), name="layer_0_key")
    vp = kv.value.encode(np.ascontiguousarray(value.transpose(heads_first)), name="layer_0_value")
    tokens, heads, D = key.shape
    krec = kp.codes.reshape(heads, tokens, -1).transpose(heads_first)
    vrec = vp.codes.reshape(heads, tokens, -1).transpose(heads_first)
    kb, vb = krec.shape[-1], vrec.shape[-1]
    assert (kb, kb + vb) == (cfg.key_packed_size, cfg.slot_size)
    assert np.array_equal(ref[..., kb:kb + vb], vrec), f"{scheme}: value records differ from vLLM's"
    if cfg.key_fp8:
        torch_cast = to_torch(key).float().to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(krec, torch_cast)
        return 0
    assert np.array_equal(ref[..., cfg.key_packed_size - 2:kb], krec[..., -2:]), f"{scheme}: norms differ"
    bits, nb = cfg.key_mse_bits, kb - 2

    def indices(rec):
        bytes_ = rec[..., :nb].reshape(-1, nb).astype(np.uint32)
        j = np.arange(D) * bits
        raw = bytes_[:, j // 8] | (np.pad(bytes_, ((0, 0), (0, 1)))[:, j // 8 + 1] << 8)
        return (raw >> (j % 8)) & ((1 << bits) - 1)

    differ = indices(ref) != indices(krec)
    near = (np.abs(y[:, :, None] - mid[None, None, :]) < 1e-6).any(axis=2)
    away = int((differ & ~near).sum())
    assert not away, f"{scheme}: {away} key indices differ away from a midpoint"
    return int(differ.sum())


@pytest.mark.parametrize("D,bits", [(64, 3), (64, 4), (128, 3), (128, 4)])
def test_centroids_are_vllms_bit_for_bit(vllm_tq, D, bits):
    want = vllm_tq[0].get_centroids(D, bits).numpy()
    assert np.array_equal(lloyd_max_centroids(D, bits).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scheme", list(PRESETS))
@pytest.mark.parametrize("D,dtype", [(128, np.float16), (64, BFLOAT16)])
def test_records_are_vllms_store_kernels_byte_for_byte(vllm_tq, scheme, D, dtype):
    rng = np.random.default_rng(D)
    tokens, heads = 24, 2
    key = rng.standard_normal((tokens, heads, D)) * np.linspace(0.1, 6, D)    # keys: outlier channels
    key[3, 1, ::5] *= 20
    value = rng.standard_normal((tokens, heads, D)) * rng.uniform(0.01, 4, (tokens, heads, 1))
    value[5, 0] = 0.25                                                         # a constant row: the scale's floor
    key, value = key.astype(dtype), value.astype(dtype)
    assert check_scheme(vllm_tq, scheme, key, value) == 0


def test_records_of_the_embedded_models_cache_are_vllms(vllm_tq, loaded):
    """Real keys and values (four of the 30 layers, 48 tokens of text): every record vLLM's kernel writes."""
    from kvcx.quality.bridge import extract_kv_cache

    model, tok, _ = loaded
    cache, _ = extract_kv_cache(model, tok, "The tower is 324 metres tall, about the same height as an 81-storey "
                                            "building, and the tallest structure in Paris. " * 2, max_length=48)
    differ = 0
    for layer in (0, 1, 15, 29):
        k = cache.layers[layer].keys[0].transpose(0, 1).to(torch.float16).numpy()     # [tokens, heads, D]
        v = cache.layers[layer].values[0].transpose(0, 1).to(torch.float16).numpy()
        for scheme in PRESETS:
            differ += check_scheme(vllm_tq, scheme, np.ascontiguousarray(k), np.ascontiguousarray(v))
    assert differ <= 2     # only at midpoints, where the GEMM's float32 rounding decides (see check_scheme)


def test_kvcx_turboquant_peer_matches_vllms_key_distortion():
    """kvcx's ``turboquant-4/-3`` peers (fused-turboquant's TurboQuantMSE: a random-sign Hadamard rotation, its own
    Lloyd-Max levels, an FP32 norm) and vLLM's keys (Sylvester Hadamard, vLLM's levels, FP16 norm, norm correction)
    lose the same to within 2 % on the same keys: the peer rows in the quality table stand for vLLM's key format."""
    fused = pytest.importorskip("fused_turboquant.core.quantizer")   # the peers extra: CI installs it
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 256, 128)) * np.linspace(0.2, 5, 128)).astype(np.float32)

    def rel(y):
        return float(np.linalg.norm(y - x) / np.linalg.norm(x))

    for bits in (4, 3):
        peer = fused.TurboQuantMSE(head_dim=128, bits=bits)
        ours = TurboQuantCodec("key", bits, norm_correction=True)
        a, b = rel(peer.decode(peer.encode(torch.from_numpy(x))).float().numpy()), rel(ours.decode(ours.encode(x)))
        assert abs(a - b) < 0.02 * b, (bits, a, b)


def test_schemes_files_sizes_and_errors(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 16, 128)).astype(np.float16)
    for scheme, bpv in (("turboquant_4bit_nc", 4.1875), ("turboquant_k3v4_nc", 3.6875), ("turboquant_3bit_nc", 3.1875),
                        ("turboquant_k8v4", 6.125)):
        cfg = KVConfig.from_scheme(scheme)
        assert (cfg.key.bits_per_value() + cfg.value.bits_per_value()) / 2 == bpv
        src, packed, back = (tmp_path / f"{scheme}{i}.safetensors" for i in range(3))
        save_file({"layer_0_key": x, "layer_0_value": x * 0.5}, str(src))
        compress_kv_cache(src, packed, scheme=scheme)
        with safe_open(str(packed), "np") as f:
            assert f.metadata()["kvcx.format_version"] == "6"     # readers before TurboQuant refuse it
        decompress_kv_cache(packed, back)
        got = load_file(str(back))
        assert np.array_equal(got["layer_0_key"], cfg.key.decode(cfg.key.encode(x)))
        assert np.array_equal(got["layer_0_value"], cfg.value.decode(cfg.value.encode(x * 0.5)))
    codec = TurboQuantCodec("key", 4, True)
    assert get_codec(codec.get_config()) == codec and eval(repr(codec), {"TurboQuantCodec": TurboQuantCodec}) == codec
    # the decoded keys are the centroids, renormalised, times the norm, rotated back: the norm survives to FP16
    y = codec.decode(codec.encode(x.astype(np.float32)))
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x.astype(np.float32), axis=-1), rtol=2e-3)
    with pytest.raises(CodecError, match="'k'.*Hadamard matrix of the head dim.*last dim is 96"):
        TurboQuantCodec("key").encode(np.ones((1, 2, 96), np.float32), name="k")
    with pytest.raises(CodecError, match="'v'.*runs of 8.*last dim is 20"):
        TurboQuantCodec("value").encode(np.ones((1, 2, 20), np.float32), name="v")
    with pytest.raises(CodecError, match="3 or 4 bits.*turboquant_k8v4"):
        TurboQuantCodec("key", 8)
    with pytest.raises(CodecError, match="for keys only"):
        TurboQuantCodec("value", 4, norm_correction=True)
    with pytest.raises(CodecError, match="'key' or 'value'"):
        TurboQuantCodec("query")
    with pytest.raises(CodecError, match="engine's format.*leave out bits=2"):
        KVConfig.from_scheme("turboquant_4bit_nc", bits=2)
    bad = rng.standard_normal((1, 4, 64)).astype(np.float32)
    bad[0, 2, 7] = np.inf
    for part in ("key", "value"):
        with pytest.raises(CodecError, match="'t' contains 1 NaN/Inf"):
            TurboQuantCodec(part).encode(bad, name="t")
    with pytest.raises(CodecError, match="'k'.*norm passes FP16.*rescale"):
        TurboQuantCodec("key").encode(np.full((1, 2, 64), 1e4, np.float32), name="k")
    with pytest.raises(CodecError, match="'v'.*range passes FP16"):
        TurboQuantCodec("value").encode(np.array([[[-3e38] * 4 + [3e38] * 4]], np.float32), name="v")


def test_damaged_records_are_errors():
    x = np.random.default_rng(2).standard_normal((1, 3, 64)).astype(np.float32)
    for part, offset, byte in (("key", 33, 0x7C), ("key", 33, 0x80), ("value", 33, 0x80), ("value", 35, 0x7C)):
        p = TurboQuantCodec(part).encode(x)      # offset: the high byte of a norm, scale or minimum in row 0
        p.codes[offset] = byte
        with pytest.raises(CodecError, match="damaged"):
            decode(p)
    p = TurboQuantCodec("value").encode(x)
    p.codes = p.codes[:-1]
    with pytest.raises(CodecError, match="expected 108 TurboQuant record bytes"):
        decode(p)


def test_vllms_boundary_layers_stay_exact_where_the_model_is_known(tmp_path):
    """vLLM keeps a dense model's first and last two layers in the model's dtype under a ``turboquant_*`` cache dtype
    (``get_boundary_skip_layers``): ``engine_layers`` says so for a model, and those layers' tensors pass through."""
    from kvcx.codecs.turboquant import boundary_layers
    from kvcx.formats.packed import compress_tensors

    centroids, config, _ = _load_vllm_config()
    for n in (1, 3, 4, 30):     # vLLM's own rule, on a stand-in for its ModelConfig
        want = config.TurboQuantConfig.get_boundary_skip_layers(_dense(n))
        assert list(boundary_layers(n)) == [int(x) for x in want]
    base = KVConfig.from_scheme("turboquant_4bit_nc")
    kv = base.engine_layers(30, hybrid=False)
    assert kv.keep_layers == (0, 1, 28, 29) and base.engine_layers(30, hybrid=True) is base
    assert KVConfig.from_scheme("nvfp4").engine_layers(30, hybrid=False).keep_layers == ()
    assert KVConfig.from_config(kv.get_config()) == kv and "layers 0, 1, 28, 29 kept exact" in kv.describe()
    assert kv.codec_for("layer_29_value") == ("kept", None) and kv.codec_for("layer_2_key")[0] == "key"
    assert kv.bits_per_value(30) == (26 * 4.1875 + 4 * 16) / 30
    rng = np.random.default_rng(3)
    tensors = {f"layer_{i}_{k}": rng.standard_normal((1, 2, 8, 128)).astype(np.float16) for i in (0, 5, 29)
               for k in ("key", "value")}
    c = compress_tensors(tensors, kv)
    assert set(c.chosen) == {"layer_5_key", "layer_5_value"}
    assert all(np.array_equal(c.tensors[n], tensors[n]) for n in tensors if not n.startswith("layer_5"))
    with pytest.raises(CodecError, match="keep_layers must be a list of layer indices"):
        KVConfig(key=base.key, value=base.value, keep_layers=(-1,))


def _load_vllm_config():
    qdir = VLLM / "model_executor/layers/quantization/turboquant"
    return _load(qdir / "centroids.py", "vllm_tq_centroids"), _load(qdir / "config.py", "vllm_tq_config"), None


def _dense(n):
    from types import SimpleNamespace

    return SimpleNamespace(is_hybrid=False, hf_text_config=SimpleNamespace(num_hidden_layers=n))


def test_validate_keeps_the_engines_exact_layers(loaded, wikitext_path):
    """``kvcx validate --scheme turboquant_4bit_nc`` on the embedded model (30 layers, dense): layers 0, 1, 28, 29
    exact as vLLM keeps them, the rest in vLLM's records; prefix and engine modes."""
    from kvcx.quality.validation import run_validations

    engine = run_validations({"turboquant_4bit_nc": KVConfig.from_scheme("turboquant_4bit_nc")}, loaded=loaded,
                             dataset_file=wikitext_path, window=256, stride=128, max_windows=1, mode="engine")[0]
    assert engine.config["keep_layers"] == [0, 1, 28, 29] and 0 < engine.kld < 0.2
    results = run_validations({"turboquant_4bit_nc": KVConfig.from_scheme("turboquant_4bit_nc")}, loaded=loaded,
                              dataset_file=wikitext_path, window=256, stride=128, max_windows=1)
    assert results[0].config["keep_layers"] == [0, 1, 28, 29]
    # 26 layers of records (4.375 bits a value at a head dim of 64) and 4 exact, counted as FP16 (what vLLM holds
    # them in on a GPU; the CPU runs the model in float32), counted whole (the file's header adds the rest)
    whole = (26 * 4.375 + 4 * 16) / 30
    assert 0 < results[0].kld < 0.1 and whole < results[0].bits_per_value < whole + 0.1
