"""StaticKvcxCache: the packed cache whose decode steps replay from a CUDA graph (kvcx.cache.static_cache).

Without a GPU (CI) Triton's interpreter runs its kernels on CPU tensors (tests/conftest.py) and what a CUDA graph
needs of a step is checked directly: the step reads nothing back to the host and launches the same work, with the
same shapes and the same integers, at every length (across a page's end), so the first step's launches are every
step's. On a CUDA machine the same tests also capture the step in a real graph and replay it. Nothing is skipped.
"""
import dataclasses
import inspect
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import kvcx.cache  # noqa: E402,F401  (registers the "kvcx" attention implementation)
from kvcx.cache import KvcxCache, StaticKvcxCache  # noqa: E402
from kvcx.cache.attention_fn import HANDOFF  # noqa: E402
from kvcx.codecs import KVConfig, gpu_attn  # noqa: E402
from kvcx.codecs.triton_kernels import attention as _triton_attn  # noqa: E402
from kvcx.codecs.triton_kernels import codec as _triton_codec  # noqa: E402
from kvcx.errors import KvcxError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTS = dict(group_size=16, residual_length=16)   # head dim 32: pages of 16 tokens, keys' blocks of 16


def _generate(model, cache, ids, n):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                              do_sample=False, output_scores=True, return_dict_in_generate=True)


def test_decode_steps_are_as_close_to_full_precision_as_kvcx_caches(tiny):
    """The same 51 tokens a row (a batch of two) through three caches: a prompt of 45 (the sink, two whole pages,
    12 in the residual), then 6 steps of one token (the residual filled by the fourth, packed on the device as a
    page at the fifth; Triton's interpreter takes a second a step here, so no more than that). Each
    step's logits differ from DynamicCache's (full precision) by what the packing costs, and StaticKvcxCache's by
    no more than KvcxCache's (the same codecs, pages cut at other tokens) give or take a quarter; the prompt's are
    DynamicCache's (its attention reads the prompt's own states)."""
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (2, 51), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits = []
    for cache in (StaticKvcxCache(tiny.config, max_cache_len=64, **OPTS),
                  KvcxCache(tiny.config, backend="triton", **OPTS), DynamicCache()):
        with torch.inference_mode():
            steps = [tiny(ids[:, :45], past_key_values=cache).logits[:, -1]]
            for t in range(45, 51):
                steps.append(tiny(ids[:, t:t + 1], past_key_values=cache,
                                  cache_position=torch.tensor([t], device=DEVICE)).logits[:, -1])
        logits.append(torch.stack(steps))
    static, packed, exact = logits
    err_static, err_kvcx = ((x - exact).abs().amax(dim=(1, 2)) for x in (static, packed))
    assert float(err_static[0]) < 1e-5 and float(err_static[1:].min()) > 0          # packed steps differ
    assert float(err_static.max()) <= 1.25 * float(err_kvcx.max()), (err_static, err_kvcx)


def test_prompts_in_chunks_and_after_decode_steps_read_the_packed_history(tiny):
    """A chunked prefill (20, 17 and 8 tokens: the later chunks attend over the decoded pages, the sinks and the
    residual), five decode steps, then a prompt of 6 tokens after them (a second turn, from a residual the device
    filled): every step's logits differ from DynamicCache's by no more than KvcxCache's do (the same chunks; give or
    take a quarter)."""
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (2, 56), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    spans = [(0, 20), (20, 37), (37, 45)] + [(t, t + 1) for t in range(45, 50)] + [(50, 56)]
    logits = []
    for cache in (StaticKvcxCache(tiny.config, max_cache_len=64, **OPTS),
                  KvcxCache(tiny.config, backend="triton", **OPTS), DynamicCache()):
        with torch.inference_mode():
            logits.append([tiny(ids[:, a:b], past_key_values=cache).logits for a, b in spans])
    for i, (static, packed, exact) in enumerate(zip(*logits)):
        err_static, err_kvcx = (float((x - exact).abs().max()) for x in (static, packed))
        assert err_static <= 1.25 * err_kvcx + 1e-6, (spans[i], err_static, err_kvcx)


def test_generate_runs_its_decode_steps_on_the_device_in_buffers_allocated_once(tiny):
    """generate() with a batch of two: the prompt from Python, then every decode step on the device; the cache's
    bytes are those of its capacity, allocated at the first step, a third of a BF16 cache's."""
    ids = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    st = StaticKvcxCache(tiny.config, max_cache_len=64, **OPTS)
    out = _generate(tiny, st, ids, 6)
    assert out.sequences.shape == (2, 51)
    rep = st.memory_report()
    assert rep["tokens"] == 50 and rep["attention_steps"] == {"device": 2 * 5, "prompt": 2}
    # allocated once for the capacity (63 packed tokens after the sink, to a whole tile: 64) a layer and slab (2 x 2):
    # codes of 4 bits, keys' FP16 scale and zero point a channel and block of 16, values' FP16 scale a group of 16
    slab = 64 * 32 // 2 * 2 + (64 // 16) * 32 * 2 * 2 + (64 * 32 // 16) * 2
    assert rep["packed_bytes"] == 2 * 4 * slab
    assert rep["residual_bytes"] == 2 * 2 * 2 * 2 * (16 + 1) * 32 * tiny.dtype.itemsize   # residual pages, sinks
    assert rep["packed_bytes"] < 0.4 * rep["bf16_static_bytes"]


def _reference(q, keys, values, scaling):
    """FP32 attention of q [B, Hq, D] over keys and values [B, Hkv, T, D] (query head j reads KV head j // R)."""
    R = q.shape[1] // keys.shape[1]
    k, v = (t.float().repeat_interleave(R, dim=1) for t in (keys, values))
    p = torch.softmax(torch.einsum("bhd,bhtd->bht", q.float() * scaling, k), dim=-1)
    return torch.einsum("bht,bhtd->bhd", p, v)


@pytest.mark.parametrize("scheme", ["kvcx", "kivi"])
def test_pages_hold_the_codecs_bytes_and_steps_attend_as_the_reference(scheme):
    """The cache driven directly, one layer: a prompt of 21 tokens, then 40 decode steps (two pages filled on the
    device). Each step's attention equals FP32 attention over the sinks, the decoded pages and the residual's
    exact tokens within FP32 rounding (the exact mode); at the end the packed pages hold the very bytes the codec
    writes for those tokens encoded whole."""
    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cfg._attn_implementation = "kvcx"
    kv = KVConfig.from_scheme(scheme, group_size=16)
    # the exact mode: within FP32 rounding of the reference
    cache = StaticKvcxCache(cfg, max_cache_len=80, kv_config=kv, residual_length=16,
                            launch=gpu_attn.LaunchSettings(dot="int8x3"))
    g = torch.Generator().manual_seed(4)
    B, H, D, T = 2, 2, 32, 61
    K = (torch.randn(B, H, T, D, generator=g) + torch.randn(D, generator=g) * 3).to(DEVICE)
    V = torch.randn(B, H, T, D, generator=g).to(DEVICE)
    t0 = kv.key.sinks
    cache.update(K[:, :, :21], V[:, :, :21], 0)
    layer = cache.layers[0]
    kc, vc = layer._codecs
    for t in range(21, T):
        k, v = K[:, :, t:t + 1], V[:, :, t:t + 1]
        cache.update(k, v, 0)
        got_layer, kind = HANDOFF.take(k)
        assert got_layer is layer and kind == "fused"
        q = torch.randn(B, 4, 1, D, generator=g).to(DEVICE)
        out = layer.attend(q, None, D ** -0.5)[:, 0]
        packed = (t - t0) // 16 * 16        # whole pages before this step's
        dk = kc.decode(kc.encode(K[:, :, t0:t0 + packed].contiguous())) if packed else K[:, :, :0]
        dv = vc.decode(vc.encode(V[:, :, t0:t0 + packed].contiguous())) if packed else V[:, :, :0]
        keys = torch.cat([K[:, :, :t0], dk, K[:, :, t0 + packed:t + 1]], dim=2)
        values = torch.cat([V[:, :, :t0], dv, V[:, :, t0 + packed:t + 1]], dim=2)
        ref = _reference(q[:, :, 0], keys, values, D ** -0.5)
        assert float((out.float() - ref).abs().max()) < 2e-5 * float(ref.abs().max()) + 1e-6, t
    assert cache.get_seq_length() == T
    pages = (T - t0) // 16
    for codec, X, (codes, scales, zeros) in ((kc, K, layer._rows(0)), (vc, V, layer._rows(1))):
        rec = codec.encode(X[:, :, t0:t0 + pages * 16].contiguous())
        assert torch.equal(codes[:, :, :pages].reshape(-1), rec.codes.reshape(-1))
        assert torch.equal(scales[:, :, :pages].reshape(-1), rec.scales.reshape(-1))
        if zeros is not None:
            assert torch.equal(zeros[:, :, :pages].reshape(-1), rec.zeros.reshape(-1))


class _Recorder(TorchDispatchMode):
    """Every torch operation of a step with its tensors' shapes; a read back to the host raises."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a decode step read a tensor back to the host (.item(), int(), bool())")
        self.ops.append((str(func), tuple((tuple(a.shape), str(a.dtype)) for a in args
                                           if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _record_launches(monkeypatch, launches):
    """Every Triton kernel launch of kvcx's (grid, kernel, integers and floats, tensors' shapes and dtypes)."""
    for module in (_triton_attn, _triton_codec):
        for name, kernel in list(vars(module).items()):
            if not (name.endswith("_kernel") and hasattr(kernel, "fn")):   # launched kernels, not helpers
                continue
            params = list(inspect.signature(kernel.fn).parameters)

            class Recorded:
                def __init__(self, real, params, name):
                    self.real, self.params, self.name = real, params, name
                    self.fn = real.fn

                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        items = list(zip(self.params, args)) + sorted(kwargs.items())
                        launches.append((self.name, tuple(grid), tuple(
                            (p, (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else v)
                            for p, v in items)))
                        return self.real[grid](*args, **kwargs)
                    return launch

            monkeypatch.setattr(module, name, Recorded(kernel, params, name))


@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek_v3"])
def test_a_decode_step_is_the_same_work_at_every_length(tiny, monkeypatch, family):
    """What replaying one captured step needs: a whole step (the model, the argmax, the position's increment, as
    bench_gpu's section 3 captures it) reads nothing back to the host (no .item(), int(), bool(), .tolist() of a
    tensor) and runs the same torch operations on the same shapes and the same Triton launches (grids, integers,
    constexprs) at every length: here six steps, the fourth filling a page; Gemma 3's sliding layer (a window of
    16) in its ring, which the prompt has wrapped; DeepSeek V3's MLA layers, whose steps decode their whole rows
    (the latent and the RoPE key) and attend with kv_b_proj absorbed. On a GPU the step is also captured in a CUDA
    graph and replayed: the tokens equal the eager steps'."""
    if family != "llama":
        tiny = _hybrid(family, 16)
    ids = torch.randint(0, 256, (2, 42), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def run(cache, steps, record=False, graph=False):
        with torch.inference_mode():
            tiny(ids, past_key_values=cache, cache_position=torch.arange(42, device=DEVICE))
            tok, pos = ids[:, -1:].clone(), torch.tensor([42], device=DEVICE)

            def step():
                logits = tiny(tok, past_key_values=cache, cache_position=pos).logits
                tok.copy_(logits[:, -1:].argmax(-1))
                pos.add_(1)

            out, seen = [], []
            if graph:
                g = _captured(step)           # a step from Python (the warm-up), then one captured and replayed
                out.append(tok.clone())
                for _ in range(steps - 1):
                    g.replay()
                    out.append(tok.clone())
                return out, seen
            for _ in range(steps):
                launches = []
                if record:
                    with monkeypatch.context() as m:
                        _record_launches(m, launches)
                        m.setattr(torch.Tensor, "tolist", _no_tolist)
                        with _Recorder() as rec:
                            step()
                    seen.append((rec.ops, launches))
                else:
                    step()
                out.append(tok.clone())
            return out, seen

    tokens, seen = run(StaticKvcxCache(tiny.config, max_cache_len=64, **OPTS), 6, record=True)
    ops, launches = seen[0]
    # four launches a layer (the keys' and the values' encode step, the attention, its merge) and no torch copy of
    # the cache's: the token goes into the residual and a full residual into its page inside the encode launch
    per_layer = [name for name, *_ in launches[:4]]
    attention = ["attend_packed_kernel", "merge_kernel"] if family != "deepseek_v3" else \
        ["decode_channel_kernel", "decode_token_kernel"]   # MLA: the rows decoded for the absorbed attention
    assert per_layer == ["encode_channel_kernel", "encode_token_kernel", *attention]
    assert len(launches) == 4 * tiny.config.num_hidden_layers
    assert not any(op.startswith(("aten.index_copy", "aten.index_put", "aten.slice_scatter")) for op, _ in ops)
    for step_ops, step_launches in seen[1:]:
        assert step_ops == ops and step_launches == launches
    if DEVICE == "cuda":   # the real thing: one step captured, replayed five times
        replayed, _ = run(StaticKvcxCache(tiny.config, max_cache_len=64, **OPTS), 6, graph=True)
        assert all(torch.equal(a, b) for a, b in zip(tokens, replayed))


def _captured(step):
    """``step`` run once from Python on a side stream (as torch.cuda.graph wants a warm-up), then captured."""
    from bench.gpu_common import capture

    return capture(torch, step, warmup=1)


def _no_tolist(self):
    raise AssertionError("a decode step read a tensor back to the host (.tolist())")


def test_what_the_static_cache_refuses_it_names(tiny, monkeypatch):
    cfg = tiny.config
    for bad in (0, 2.5, True):
        with pytest.raises(KvcxError, match="max_cache_len must be a positive integer"):
            StaticKvcxCache(cfg, max_cache_len=bad)
    with pytest.raises(KvcxError, match="residual_length must be a power of two from 16"):
        StaticKvcxCache(cfg, max_cache_len=64, residual_length=24)
    with pytest.raises(KvcxError, match="residual_length .16. must be a multiple of the keys' group .64"):
        StaticKvcxCache(cfg, max_cache_len=64, residual_length=16)
    with pytest.raises(KvcxError, match="not one the Triton kernels run.*4-bit"):
        StaticKvcxCache(cfg, max_cache_len=64, scheme="kvcx3", group_size=16, residual_length=16)
    with pytest.raises(KvcxError, match="keeps? .* sink|same sink"):
        StaticKvcxCache(cfg, max_cache_len=64, kv_config=dataclasses.replace(
            KVConfig.from_scheme("kivi", group_size=16), value=KVConfig.from_scheme("kvcx", group_size=16).value),
            residual_length=16)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with pytest.raises(KvcxError, match="20 more does not fit.*larger max_cache_len"):
        _generate(tiny, StaticKvcxCache(cfg, max_cache_len=10, **OPTS), ids, 2)
    tiny.set_attn_implementation("sdpa")
    try:
        with pytest.raises(KvcxError, match="attention to be 'kvcx'.*set_attn_implementation"):
            _generate(tiny, StaticKvcxCache(cfg, max_cache_len=64, **OPTS), ids, 2)
    finally:
        tiny.set_attn_implementation("kvcx")
    padded = torch.ones(2, 20, dtype=torch.long, device=DEVICE)
    padded[1, :3] = 0
    with pytest.raises(KvcxError, match="rows of equal length.*KvcxCache for padded"):
        with torch.inference_mode():
            tiny.generate(ids.repeat(2, 1), attention_mask=padded, past_key_values=StaticKvcxCache(
                cfg, max_cache_len=64, **OPTS), max_new_tokens=3, do_sample=False)
    if DEVICE == "cpu":   # the Triton kernels on CPU tensors only in the interpreter
        with monkeypatch.context() as m:
            m.setattr(gpu_attn, "interpreting", lambda: False)
            with pytest.raises(KvcxError, match="needs triton .* and a CUDA model, not one on cpu.*use KvcxCache"):
                _generate(tiny, StaticKvcxCache(cfg, max_cache_len=64, **OPTS), ids, 2)
    cache = StaticKvcxCache(cfg, max_cache_len=64, **OPTS)
    with pytest.raises(KvcxError, match="cannot drop tokens"):
        _generate(tiny, cache, ids, 2)
        cache.crop(10)


def test_a_step_past_the_capacity_raises_from_python_and_is_flagged_in_a_graph(tiny):
    """From Python, the step that would not fit raises before it runs (the tokens held stay what they were). Inside
    a replayed CUDA graph a step cannot raise: past max_cache_len it writes within the buffers (the last page's
    place) and flags it on the device; the next read from Python raises (on a GPU: captured and replayed here)."""
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    cache = StaticKvcxCache(tiny.config, max_cache_len=32, **OPTS)
    with torch.inference_mode():
        tiny(ids, past_key_values=cache)
        tok = ids[:, -1:]
        for _ in range(2):     # two steps fit
            tiny(tok, past_key_values=cache)
        with pytest.raises(KvcxError, match="holds max_cache_len=32 tokens: a step of one more does not fit"):
            tiny(tok, past_key_values=cache)
    assert cache.tokens == 32
    if DEVICE == "cuda":
        cache = StaticKvcxCache(tiny.config, max_cache_len=32, **OPTS)
        with torch.inference_mode():
            tiny(ids, past_key_values=cache)
            g = _captured(lambda: tiny(tok, past_key_values=cache))   # one step from Python, one captured
            for _ in range(3):                         # the second replay is past the capacity
                g.replay()
        with pytest.raises(KvcxError, match="ran past max_cache_len=32.*replayed graph"):
            cache.memory_report()


def test_capacity_is_whole_tiles():
    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cache = StaticKvcxCache(cfg, max_cache_len=1000, **OPTS)
    cap = cache._holder.capacity(1000, 1)
    assert cap % gpu_attn.TILE_TOKENS == 0 and cap >= 999 and cap - 999 < math.lcm(16, gpu_attn.TILE_TOKENS)


def test_a_decode_step_of_non_finite_states_is_flagged_and_check_raises():
    """A step replayed from a graph cannot raise: keys or values of NaN (a model gone wrong) are flagged by the
    encoder on the device and check() (and memory_report()) raise, naming the layer; finite steps pass it."""
    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cfg._attn_implementation = "kvcx"
    cache = StaticKvcxCache(cfg, max_cache_len=40, **OPTS)
    K = torch.randn(1, 2, 20, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    cache.update(K, K, 0)
    k = K[:, :, :1].clone()
    cache.update(k, k, 0)
    HANDOFF.take(k)
    assert cache.check() == 21
    bad = torch.full_like(k, float("nan"))
    cache.update(bad, bad, 0)
    HANDOFF.take(bad)
    with pytest.raises(KvcxError, match="layer 0: a decode step's keys or values held NaN or Inf"):
        cache.memory_report()


def _hybrid(family: str, window: int = 24):
    """A tiny random 2-layer hybrid of ``family`` with kvcx's attention (its first layer the hybrid kind, its
    second full attention)."""
    import transformers as T

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    if family == "gemma3":
        cfg = T.Gemma3TextConfig(**common, sliding_window=window, layer_types=["sliding_attention", "full_attention"])
    elif family == "deepseek_v3":   # MLA: a latent of 64 and a RoPE key of 32, both layers
        cfg = T.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=64,
                                 qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2,
                                 n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1)
    elif family == "llama4":
        cfg = T.Llama4TextConfig(**common, intermediate_size_mlp=128, attention_chunk_size=window,
                                 layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0])
    else:
        cfg = T.Qwen3_5TextConfig(**common, layer_types=["linear_attention", "full_attention"],
                                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                  linear_value_head_dim=16)
    cfg.eos_token_id = None
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg, attn_implementation="kvcx").eval().to(DEVICE)


@pytest.mark.parametrize("family, window, first", [("gemma3", 24, ("StaticKvcxWindowLayer", "packed")),
                                                   ("llama4", 32, ("StaticKvcxWindowLayer", "packed")),
                                                   ("qwen3_5", None, ("LinearAttentionLayer", "kept"))])
def test_hybrid_models_pack_their_attention_layers_and_keep_the_others(family, window, first):
    """Gemma 3 (sliding + full), Llama 4 (chunked + full) and Qwen 3.5 (linear + full): full layers packed, sliding
    and chunked ones packed into a ring of pages, linear ones in their own class; a 40-token prompt
    (the ring wraps), then 6 greedy tokens equal KvcxCache's (the same codecs), every packed layer's decode steps
    on the device, and the window layers hold the ring, never the whole context."""
    model = _hybrid(family, window or 24)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    static = StaticKvcxCache(model.config, max_cache_len=128, **OPTS)
    ref = KvcxCache(model.config, backend="triton", **OPTS)
    a, b = _generate(model, static, ids, 6), _generate(model, ref, ids, 6)
    rep = static.memory_report()
    assert (type(static.layers[0]).__name__, rep["layers"][0]["kvcx"]) == first
    assert rep["layers"][1]["kvcx"] == "packed"
    packed = 2 if first[1] == "packed" else 1
    assert rep["attention_steps"]["device"] == 5 * packed and (rep["kept_bytes"] > 0) == (packed == 1)
    assert torch.equal(a.sequences, b.sequences)
    if packed == 2:   # the ring: the window rounded up to whole tiles of the kernel (64 tokens), not the capacity
        ring = static.layers[0]
        assert ring.pool.page_tokens == 64 < static.layers[1].pool.page_tokens
        assert ring.get_max_cache_shape() == window


@pytest.mark.parametrize("chunked", [False, True])
def test_a_windowed_layer_attends_over_its_window_in_the_ring(chunked):
    """One windowed layer's decode steps, 28 of them after a 70-token prompt (a ring of four pages of 16: two of
    the steps overwrite a page, the others read the wrapped ring), against attention over the window's tokens as
    the codec holds them (each page encoded alone, the residual exact): within the kernel's rounding (2e-3), and a
    window one token longer or shorter is off by more (the mask is the window's, to the token). Then a prompt of
    20 more: what it returns is the window before it as held, then its own tokens."""
    import transformers as T

    W, P, D, H, Hq = (32 if chunked else 40), 16, 32, 2, 4
    if chunked:
        cfg = T.Llama4TextConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=Hq,
                                 num_key_value_heads=H, head_dim=D, attention_chunk_size=W,
                                 layer_types=["chunked_attention"], no_rope_layers=[1])
    else:
        cfg = T.MistralConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=Hq,
                              num_key_value_heads=H, head_dim=D, sliding_window=W)
    cfg._attn_implementation = "kvcx"
    cache = StaticKvcxCache(cfg, max_cache_len=400, group_size=16, residual_length=P)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    N, S0 = 98, 70
    K, V = (torch.randn(1, H, N + 20, D, generator=g).to(DEVICE) for _ in "kv")
    cache.update(K[:, :, :S0], V[:, :, :S0], 0)
    kc, vc = layer._codecs

    pages = [torch.cat([c.decode(c.encode(x[:, :, s:s + P].contiguous())) for s in range(0, N, P)], 2)
             for x, c in ((K, kc), (V, vc))]   # every page packed alone

    def held(kind, p):   # tokens to p as the layer holds them: the pages before p's packed, then exact
        c = p - p % P
        return torch.cat([pages[kind][:, :, :c], (K, V)[kind][:, :, c:p + 1]], 2)

    def reference(q, p, first):
        kk, vv = (held(kind, p).repeat_interleave(Hq // H, 1)[:, :, first:] for kind in (0, 1))
        return torch.softmax(q @ kk.transpose(-1, -2) * D ** -0.5, -1) @ vv

    worst, margin = 0.0, float("inf")
    for p in range(S0, N):
        cache.update(K[:, :, p:p + 1].contiguous(), V[:, :, p:p + 1].contiguous(), 0)
        q = torch.randn(1, Hq, 1, D, generator=g).to(DEVICE)
        with torch.inference_mode():
            out = layer.attend(q, None, D ** -0.5).transpose(1, 2).float()
        first = (p // W) * W if chunked else max(p - W + 1, 0)
        worst = max(worst, float((out - reference(q, p, first)).abs().max()))
        for off in (-1, 1):
            if 0 <= first + off <= p:
                margin = min(margin, float((out - reference(q, p, first + off)).abs().max()))
    assert worst < 2e-3 and margin > 5 * worst, (worst, margin)
    keys, values = cache.update(K[:, :, N:], V[:, :, N:], 0)
    first = N - W + 1   # transformers' mask covers the last window - 1 tokens (chunked layers' too) and the step's
    assert torch.equal(keys, torch.cat([held(0, N - 1)[:, :, first:], K[:, :, N:]], 2))
    assert torch.equal(values, torch.cat([held(1, N - 1)[:, :, first:], V[:, :, N:]], 2))
    assert layer.steps == {"device": N - S0, "prompt": 2}


@pytest.mark.parametrize("batch", [1, 3])
def test_mla_layers_pack_the_latent_and_attend_with_kv_b_proj_absorbed(batch):
    """DeepSeek V3 (MLA; transformers' StaticCache takes it): the latent and the RoPE key packed in rows of the
    capacity, a decode step the two encode launches and the rows decoded on the device for the absorbed attention;
    a 40-token prompt then 8 greedy tokens (across two pages' ends) at batch 1 and 3 equal KvcxCache's on the same
    codecs (its logits within 1e-2 of them: the two pack the prompt's tail at different steps), every decode step
    on the device, and the packed rows and residual hold under half of what a BF16 StaticCache of the capacity
    holds for the same latent, with one layer's decoded context of scratch the layers share."""
    model = _hybrid("deepseek_v3")
    ids = torch.randint(3, 256, (batch, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    static = StaticKvcxCache(model.config, max_cache_len=256, **OPTS)
    ref = KvcxCache(model.config, backend="triton", **OPTS)
    a, b = _generate(model, static, ids, 8), _generate(model, ref, ids, 8)
    assert torch.equal(a.sequences, b.sequences)
    assert max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores)) < 1e-2
    assert all(r["steps"]["absorbed"] == 7 for r in ref.memory_report()["layers"])
    rep = static.memory_report()
    assert [type(layer).__name__ for layer in static.layers] == ["StaticKvcxLatentLayer"] * 2
    assert rep["attention_steps"] == {"device": 2 * 7, "prompt": 2} and rep["tokens"] == 47
    held = rep["packed_bytes"] + rep["residual_bytes"]
    assert held < 0.5 * rep["bf16_static_bytes"], rep
    cap = static.layers[0]._capacity()
    assert rep["scratch_bytes"] == batch * (static.layers[0].t0 + cap + 16) * (64 + 32) * 4   # one layer's, FP32


def test_an_mla_layer_decodes_what_its_pages_hold_under_the_plans_mask():
    """One MLA layer's decode steps, 40 after a 37-token prompt (pages of 16 filled on the device): the context a
    step reads, under its mask, is the sinks exact, every page encoded alone and decoded, then the residual exact,
    to the bit, in transformers' order; what the mask hides is never a held token. A mask given from Python (a
    padded batch) and expanded states (transformers before 5.17) are refused naming the fix."""
    model = _hybrid("deepseek_v3")
    cache = StaticKvcxCache(model.config, max_cache_len=128, **OPTS)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    N, S0 = 77, 37
    C, R = torch.randn(1, 1, N, 64, generator=g).to(DEVICE), torch.randn(1, 1, N, 32, generator=g).to(DEVICE)
    for i in (0, 1):
        cache.update(C[:, :, :S0], R[:, :, :S0], i)
    kc, vc = layer._codecs
    t0, P = layer.t0, 16

    def held(x, codec, p):   # tokens to p as a step reads them: sinks exact, the pages before p's packed alone, then
        c = t0 + (p - t0) // P * P   # p's page exact (the residual: read exact at the step that fills it too)
        pages = [codec.decode(codec.encode(x[:, :, s:s + P].contiguous())) for s in range(t0, c, P)]
        return torch.cat([x[:, :, :t0], *pages, x[:, :, c:p + 1]], 2)

    for p in range(S0, N):
        cache.update(C[:, :, p:p + 1].contiguous(), R[:, :, p:p + 1].contiguous(), 0)
        assert HANDOFF.take_latent(model.model.layers[0].self_attn) is layer
        lat, rope, mask = layer.latent_states(None)
        keep = mask[0, 0, 0]
        assert int(keep.sum()) == p + 1
        assert torch.equal(lat[0, 0][keep], held(C, kc, p)[0, 0])
        assert torch.equal(rope[0, 0][keep], held(R, vc, p)[0, 0])
    with pytest.raises(KvcxError, match="rows of equal length"):
        layer.latent_states(torch.ones(1, 1, 1, N + 1, dtype=torch.bool))
    fresh = StaticKvcxCache(model.config, max_cache_len=64, **OPTS)
    with pytest.raises(KvcxError, match=r"layer 0 .*MLA.* not its latent and RoPE key.*5\.17"):
        fresh.update(torch.randn(1, 4, 8, 64).to(DEVICE), torch.randn(1, 4, 8, 32).to(DEVICE), 0)
    # a full layer handed keys and values of two widths (its kernel reads one): refused, not read wrong
    llama = StaticKvcxCache(_hybrid("gemma3", 16).config, max_cache_len=64, **OPTS)
    with pytest.raises(KvcxError, match="layer 1: keys of 32 channels and values of 16.*use KvcxCache"):
        llama.update(torch.randn(1, 2, 8, 32).to(DEVICE), torch.randn(1, 2, 8, 16).to(DEVICE), 1)


def test_hybrid_refusals_name_the_layer(tiny):
    import transformers as T

    from bench.families import unsupported_config

    with pytest.raises(KvcxError, match="StaticKvcxCache: layers 1 .* unsupported='keep'"):
        StaticKvcxCache(unsupported_config(), max_cache_len=64)
    no_full = T.Gemma3TextConfig(num_hidden_layers=1, layer_types=["sliding_attention"], head_dim=32,
                                 hidden_size=64, num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    with pytest.raises(KvcxError, match="sliding and chunked layers and this model has none it can pack"):
        StaticKvcxCache(no_full, max_cache_len=64, **OPTS)
    # a window smaller than a page, or chunks of part pages: kept in transformers' class, memory_report says why
    for family, window, why in (("gemma3", 8, "smaller than a page"), ("llama4", 24, "not whole pages")):
        cache = StaticKvcxCache(_hybrid(family, window).config, max_cache_len=64, **OPTS)
        assert type(cache.layers[0]).__name__ == "StaticSlidingWindowLayer"
        first = cache.memory_report()["layers"][0]
        assert first["kvcx"] == "kept" and why in first["why"] and "residual_length" in first["why"]
