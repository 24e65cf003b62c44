"""KvcxCache with its packed store on the device (the Triton backend): generate() through the Triton encoder and
fused attention, the same packed bytes as the CPU store, multi-token steps, memory and errors.

Without a GPU (CI) ``backend="triton"`` forces the device store on CPU tensors and Triton's interpreter runs
its kernels (tests/conftest.py); on a CUDA machine the same tests run on the GPU. Nothing is skipped.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig  # noqa: E402

import kvcx.cache  # noqa: E402,F401  (registers the "kvcx" attention implementation)
from kvcx.cache.device_store import DeviceChunkKV, DevicePackedKV, decodes_on_device, runs_on_device  # noqa: E402
from kvcx.cache.kvcx_cache import KvcxCache  # noqa: E402
from kvcx.codecs import KVConfig, get_codec, gpu_attn  # noqa: E402
from kvcx.errors import CodecError, KvcxError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# head dim 32; groups of 32 (keys per channel: the first chunk's 63 packed tokens after the sink end in a partial
# block, so the store holds two segments, as in real use)
OPTS = dict(group_size=32, residual_length=32)


def _generate(model, cache, ids, mask, n=14):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)


def _codes(store, kind):
    """A store's packed codes of ``kind`` as one host array: the device store's segments joined."""
    if isinstance(store, DevicePackedKV):
        spans = [s.keys if kind == "key" else s.values for s in store.segments]
        return torch.cat([s.codes[:, :s.tokens * 16] for s in spans], 1).cpu().numpy()
    return (store.keys if kind == "key" else store.values).codes


def test_the_device_store_packs_the_cpu_stores_bytes():
    """The same keys and values through update() (a 90-token prefill, then 14 single-token steps, a batch of two):
    the device store's packed codes and sinks are the CPU store's, byte for byte, segment by segment, and the
    states a step returns are equal."""
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cpu = KvcxCache(cfg, backend="cpu", fused=False, **OPTS)
    dev = KvcxCache(cfg, backend="triton", fused=False, **OPTS)
    g = torch.Generator().manual_seed(2)
    for n in [90] + [1] * 14:
        for i in range(2):
            k, v = torch.randn(2, 2, 2, n, 32, generator=g).to(DEVICE)
            (a, b), (c, d) = cpu.update(k.cpu(), v.cpu(), i), dev.update(k.clone(), v.clone(), i)
            assert torch.equal(a, c.cpu()) and torch.equal(b, d.cpu())
    for lc, ld in zip(cpu.layers, dev.layers):
        store = ld.store
        assert isinstance(store, DevicePackedKV) and len(store.segments) == 2 and store.tokens == lc.store.tokens
        assert store.segments[0].keys.codes.device.type == DEVICE
        for kind, host in (("key", lc.store.keys), ("value", lc.store.values)):
            assert np.array_equal(_codes(store, kind), host.codes)
            assert np.array_equal(store.sinks[kind].cpu().numpy(), host.sinks.reshape(store.N, 1, 32))


def test_generate_through_the_triton_path_equals_the_cpu_path(tiny):
    """A left-padded batch of two: every decode step runs the Triton attention over the device store (its default
    FP16 products, FP32 sums) and the greedy tokens equal the CPU kernels' path (FP32). The logits differ by under
    1 % of what the compression itself moves them (an exact DynamicCache, the same run): the FP16 products' rounding,
    and the few values it carries across a rounding boundary when the residual is packed (a code one level off;
    the same inputs give the same bytes: the test above)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 90), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    cpu = KvcxCache(tiny.config, backend="cpu", **OPTS)
    dev = KvcxCache(tiny.config, backend="triton", **OPTS)
    a, b = _generate(tiny, cpu, ids, mask), _generate(tiny, dev, ids, mask)
    exact = _generate(tiny, DynamicCache(config=tiny.config), ids, mask)
    assert dev.backend == "triton" and cpu.backend == "cpu" and dev.memory_report()["backend"] == "triton"
    steps = dev.memory_report()["attention_steps"]
    assert steps["fused"] == 2 * 13 and steps["materialised"] == 0
    assert torch.equal(a.sequences, b.sequences)
    between = max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores))
    compression = max(float((x - y).abs().max()) for x, y in zip(a.scores, exact.scores))
    assert between < 0.01 * compression, (between, compression)
    for lc, ld in zip(cpu.layers, dev.layers):
        assert ld.store.tokens == lc.store.tokens
        for kind in ("key", "value"):
            x, y = (_codes(store, kind).astype(int) for store in (lc.store, ld.store))
            off = np.abs(np.stack([(x & 15) - (y & 15), (x >> 4) - (y >> 4)]))   # two 4-bit codes a byte
            assert off.max() <= 1 and np.count_nonzero(off) <= off.size // 1000, (kind, np.count_nonzero(off))
    rep = dev.memory_report()
    assert rep["packed_bytes"] == sum(layer.store.nbytes for layer in dev.layers)
    assert rep["scratch_bytes"] < 4096                     # no full-precision copy of the context, only the mask


def test_decode_steps_launch_no_kernel_triton_would_compile_again(tiny, monkeypatch):
    """Triton compiles a kernel again for each new combination of its integer arguments being 1 or a multiple of 16
    and of its tensors' dtypes and 16-byte alignment: on a GPU a second or more in the middle of a generation.
    Across decode steps (the mask a column wider each step, the residual a token longer, a flush) the attention
    kernel sees one combination and the merge one per block of residual tokens (a power of two from 16: 16, 32 and
    64 for a residual of up to 64): the integers that change are passed without specialization
    (``_triton_attn._STEP_ARGS``, ``_MERGE_STEP_ARGS``)."""
    import inspect

    from kvcx.codecs.triton_kernels import attention as _triton_attn
    from kvcx.codecs.triton_kernels import merge as _triton_merge

    seen, raw = {}, {}

    def key(params, args, kwargs, skip):
        out = []
        for p, v in list(zip(params, args)) + sorted(kwargs.items()):
            if p in skip:
                continue
            if isinstance(v, torch.Tensor):
                out.append((p, str(v.dtype), v.data_ptr() % 16 == 0))
            elif isinstance(v, int) and not isinstance(v, bool) and p in params[:len(args)]:
                out.append((p, v == 1, v % 16 == 0))
            elif not isinstance(v, float):
                out.append((p, v))          # constexprs and launch options
        return tuple(out)

    for name, skip in (("attend_packed_kernel", _triton_attn._STEP_ARGS),
                       ("merge_kernel", _triton_merge._MERGE_STEP_ARGS)):
        real = getattr(_triton_attn, name)
        params = list(inspect.signature(real.fn).parameters)

        class Recorded:
            def __getitem__(self, grid, real=real, params=params, skip=skip, name=name):
                def launch(*args, **kwargs):
                    seen.setdefault(name, set()).add(key(params, args, kwargs, skip))
                    raw.setdefault(name, set()).add(key(params, args, kwargs, ()))
                    return real[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(_triton_attn, name, Recorded())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 90), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    _generate(tiny, KvcxCache(tiny.config, backend="triton", **OPTS), ids, mask, n=9)
    assert len(raw["attend_packed_kernel"]) > 1 and len(raw["merge_kernel"]) > 1   # the steps' integers do change
    assert len(seen["attend_packed_kernel"]) == 1, seen["attend_packed_kernel"]
    blocks = {e[1] for k in seen["merge_kernel"] for e in k if e[0] == "RB"}
    assert len(seen["merge_kernel"]) == len(blocks) and blocks <= {16, 32, 64}, seen["merge_kernel"]


def test_multi_token_steps_decode_into_device_scratch(tiny):
    """Steps of several tokens over a packed history (a prompt's later chunks) decode the device store into
    device scratch: the logits equal the CPU store's materialising path."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (1, 110), generator=g).to(DEVICE)
    out = {}
    for backend, fused in (("cpu", False), ("triton", None)):
        cache = KvcxCache(tiny.config, backend=backend, fused=fused, **OPTS)
        with torch.inference_mode():
            tiny(ids[:, :64], past_key_values=cache)
            out[backend] = tiny(ids[:, 64:], past_key_values=cache).logits
        assert cache.memory_report()["attention_steps"]["materialised"] == 2   # one step, two layers
    assert float((out["cpu"] - out["triton"]).abs().max()) < 1e-4
    with torch.inference_mode():
        ref = tiny(ids, past_key_values=DynamicCache()).logits[:, 64:]
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), out["triton"].flatten(), dim=0)
    assert cos > 0.99


def test_the_backend_is_chosen_by_device_and_checked():
    cfg = KVConfig.from_scheme()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert runs_on_device(cfg.key, cfg.value, cuda)                    # 4-bit codecs on CUDA: the device store
    assert not runs_on_device(cfg.key, cfg.value, cpu)                 # on the CPU: the CPU kernels
    low = KVConfig.from_scheme("kvcx3")
    assert not runs_on_device(low.key, low.value, cuda)                # 3-bit codes: the CPU store (no Triton kernel)
    on = cfg.with_backend("triton")
    assert runs_on_device(on.key, on.value, cpu)                       # forced (the interpreter runs it)
    off = cfg.with_backend("cpu")
    assert not runs_on_device(off.key, off.value, cuda)
    small = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=64)
    with pytest.raises(KvcxError, match="runs 4-bit integer, E8P and widths codecs.*3-bit"):
        KvcxCache(small, scheme="kvcx3", backend="triton")
    # E8P values and widths keys run on the device, where the fused attention does not read them: decoded there
    for scheme in ("kvcx2v", "kvcx4w"):
        two = KVConfig.from_scheme(scheme)
        assert decodes_on_device(two.key, two.value, cuda) and not runs_on_device(two.key, two.value, cuda)
        assert not decodes_on_device(two.key, two.value, cpu)
    assert not decodes_on_device(cfg.key, cfg.value, cuda)            # fused there instead
    assert not decodes_on_device(low.key, low.value, cuda)            # 3-bit codes: the CPU store
    with pytest.raises(CodecError, match="backend 'gpu' is not supported"):
        KvcxCache(small, backend="gpu")
    # engine formats have no Triton kernels: "cpu" is theirs to name, "triton" is refused by name
    assert KvcxCache(small, scheme="q4_0", backend="cpu").layers[0]._codecs_next["key"].backend == "cpu"
    with pytest.raises(KvcxError, match="runs 4-bit integer, E8P and widths codecs.*q4_0"):
        KvcxCache(small, scheme="q4_0", backend="triton")


@pytest.mark.parametrize("scheme", ["kvcx2v", "kvcx4w"])
def test_kvcx2v_and_kvcx4w_keep_their_records_on_the_device(tiny, scheme):
    """kvcx2v (widths keys, E8P values) and kvcx4w (widths keys, 4-bit values) on the Triton backend: the records are
    encoded and kept on the device (DeviceChunkKV) and each step decodes them there; the Triton kernels write the
    CPU kernels' bytes, so the logits equal the CPU store's materialised path exactly (a left-padded batch of two,
    the residual packed several times). memory_report() says why the steps are not fused and counts the records."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (2, 150), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    cpu = KvcxCache(tiny.config, scheme=scheme, backend="cpu", fused=False)
    dev = KvcxCache(tiny.config, scheme=scheme, backend="triton")
    a, b = _generate(tiny, cpu, ids, mask, n=8), _generate(tiny, dev, ids, mask, n=8)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))
    rep = dev.memory_report()
    assert dev.backend == "triton" and rep["attention_steps"] == {"fused": 0, "materialised": 2 * 7,
                                                                  "full_precision": 2}
    for lc, ld in zip(cpu.layers, dev.layers):
        assert isinstance(ld.store, DeviceChunkKV) and ld.store.tokens == lc.store.tokens == 128
        assert all(p.codes.device.type == DEVICE for chunk in ld.store._chunks for p in (chunk.key, chunk.value))
        assert "decodes its packed context there" in ld.fused_unsupported
        assert abs(ld.store.nbytes - lc.store.nbytes) <= 0.01 * lc.store.nbytes   # the host store pads its planes
    assert rep["packed_bytes"] == sum(layer.store.nbytes for layer in dev.layers)


def test_a_windowed_layer_drops_the_records_its_window_leaves():
    """A sliding window of 64 over a 400-token prompt (the window passes six times) with kvcx2v on the device: the
    windowed layers drop whole chunks of records as the window leaves them, hold at most the window and a chunk
    packed, and the logits equal the CPU store's."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                        intermediate_size=256, vocab_size=256, max_position_embeddings=1024, sliding_window=64)
    model = MistralForCausalLM(cfg).eval().to(DEVICE)
    model.set_attn_implementation("kvcx")
    ids = torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cpu = KvcxCache(cfg, scheme="kvcx2v", backend="cpu", fused=False)
    dev = KvcxCache(cfg, scheme="kvcx2v", backend="triton")
    a, b = (_generate(model, c, ids, torch.ones_like(ids), n=6) for c in (cpu, dev))
    assert torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))
    for lc, ld in zip(cpu.layers, dev.layers):
        assert isinstance(ld.store, DeviceChunkKV) and ld.store.tokens == lc.store.tokens <= 64 + 64
        assert len(ld.store) == len(lc.store)


def test_device_store_errors_and_what_it_cannot_fuse():
    from kvcx.codecs import IntCodec

    store = DevicePackedKV(1, 2, 32, torch.device(DEVICE))
    kc = IntCodec(scheme="asymmetric", axis="channel", group_size=32, sinks=1, backend="triton")
    vc = IntCodec(scheme="symmetric", group_size=32, sinks=2, backend="triton")
    x = torch.randn(1, 2, 64, 32, device=DEVICE)
    with pytest.raises(CodecError, match="do not fit this store"):
        store.append(kc.encode(x), vc.encode(x[..., :16].contiguous()))
    store.append(kc.encode(x), vc.encode(x))
    assert "same sink tokens" in store.unsupported(2)
    with pytest.raises(CodecError, match="only the first packed chunk"):
        store.append(kc.encode(x), vc.encode(x))
    out = torch.empty(1, 2, 64, 32, device=DEVICE)
    for kind, codec in (("key", kc), ("value", vc)):   # sinks that differ still decode, kind by kind
        assert store.decode_into(kind, out) == 64
        assert torch.equal(out, codec.decode(codec.encode(x)))
    odd = DevicePackedKV(1, 1, 48, torch.device(DEVICE))
    assert "power of two" in odd.unsupported(1)


def test_the_store_decodes_to_the_dtype_it_is_given():
    """decode_into writes the dtype of its out tensor: FP32 (a reference without the model dtype's rounding)
    rounds to the BF16 decode bit for bit; other dtypes are refused by name."""
    cfg = KVConfig.from_scheme().with_backend("triton")
    x = torch.randn(1, 2, 100, 32, device=DEVICE).to(torch.bfloat16)
    store = DevicePackedKV(1, 2, 32, torch.device(DEVICE))
    kc, vc = (get_codec({**c.get_config(), "group_size": 32}).with_backend("triton") for c in (cfg.key, cfg.value))
    store.append(kc.encode(x), vc.encode(x))
    for kind in ("key", "value"):
        wide = torch.full((1, 2, 100, 32), float("nan"), device=DEVICE)
        narrow = torch.empty(1, 2, 100, 32, dtype=torch.bfloat16, device=DEVICE)
        assert store.decode_into(kind, wide) == store.decode_into(kind, narrow) == 100
        assert not bool(torch.isnan(wide).any()) and torch.equal(wide.to(torch.bfloat16), narrow)
        assert float((wide - narrow.float()).abs().max()) > 0          # FP32 keeps what BF16 rounds away
    with pytest.raises(CodecError, match="value.*float16, bfloat16 or float32.*torch.int32"):
        store.decode_into("value", torch.empty(1, 2, 100, 32, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_step_written_in_the_models_dtype_is_the_float32_step_rounded(dtype):
    """A decode step's merge writes the model's dtype itself (attend_in_dtype: no conversion launched after it, what
    KvcxCache's and StaticKvcxCache's steps do): the FP32 step rounded to nearest even, as .to rounds, bit for bit;
    a dtype the merge does not write gets no buffer (the FP32 output is converted)."""
    from kvcx.cache.device_store import attend_in_dtype

    cfg = KVConfig.from_scheme().with_backend("triton")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 100, 32, generator=g).to(DEVICE, dtype)
    store = DevicePackedKV(1, 2, 32, torch.device(DEVICE))
    kc, vc = (get_codec({**c.get_config(), "group_size": 32}).with_backend("triton") for c in (cfg.key, cfg.value))
    store.append(kc.encode(x), vc.encode(x))
    q = torch.randn(1, 4, 1, 32, generator=g).to(DEVICE, dtype)
    rk, rv = (torch.randn(1, 2, 3, 32, generator=g).to(DEVICE, dtype) for _ in "kv")
    wide = store.attend(q.view(1, 4, 32), rk, rv, None, 32 ** -0.5)
    given = []

    def attend(o):
        given.append(o)
        return store.attend(q.view(1, 4, 32), rk, rv, None, 32 ** -0.5, out=o)

    out = attend_in_dtype(q, attend)
    assert out.shape == (1, 1, 4, 32) and out.dtype == dtype and given[0].dtype == dtype
    assert wide.dtype == torch.float32 and torch.equal(out.view(1, 4, 32), wide.to(dtype))
    given.clear()
    assert attend_in_dtype(q.double(), lambda o: given.append(o) or wide).dtype == torch.float64
    assert given == [None]


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_windows_softcap_and_sinks_on_the_device_equal_the_cpu_path(family):
    """Sliding layers (a window of 40: its first token mid-block, chunks dropped as it moves), Gemma 2's logit
    softcapping and GPT-OSS's per-head sinks through the Triton kernels (the interpreter without a GPU): every
    decode step fused, the logits the CPU kernels' within FP32 rounding, the windows' packed chunks dropped on the
    device as on the host."""
    import transformers as T

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, sliding_window=40, max_position_embeddings=512,
                  layer_types=["sliding_attention", "full_attention"])
    cfg = T.Gemma2Config(**common, attn_logit_softcapping=3.0) if family == "gemma2" else \
        T.GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1)
    cfg.eos_token_id = None
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="kvcx").eval().to(DEVICE)
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (2, 130), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cpu = KvcxCache(model.config, backend="cpu", **OPTS)
    # FP32 sums: the CPU kernels' arithmetic, to compare within rounding
    dev = KvcxCache(model.config, backend="triton", launch=gpu_attn.LaunchSettings(dot=""), **OPTS)
    a = _generate(model, cpu, ids, mask, n=8)
    b = _generate(model, dev, ids, mask, n=8)
    steps = dev.memory_report()["attention_steps"]
    assert steps["fused"] == 2 * 7 and steps["materialised"] == 0, steps
    worst = max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(a.scores, b.scores))
    assert worst < 2e-5, worst   # FP32 rounding: the kernels sum in other orders
    assert torch.equal(a.sequences, b.sequences)
    window_cpu, window_dev = cpu.layers[0], dev.layers[0]
    assert window_dev.start == window_cpu.start > 0 and window_dev.store.tokens == window_cpu.store.tokens <= 40 + 32
