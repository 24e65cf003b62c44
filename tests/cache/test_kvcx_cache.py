"""KvcxCache on the real embedded model: memory, token agreement, generate(), GQA, padding, dtypes, presets."""
import numpy as np
import pytest

from kvcx.api import load_plan
from kvcx.codecs import KVConfig
from kvcx.errors import KvcxError, ModelError

from helpers import plan_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvcx.deps import check_transformers  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def wiki_ids(loaded, wikitext_path):
    _, tok, _ = loaded
    text = wikitext_path.read_text(encoding="utf-8")[:60000]
    return torch.tensor(tok(text)["input_ids"][:4200])[None]


def test_memory_at_4096_tokens(loaded, wiki_ids):
    from kvcx.cache.kvcx_cache import KvcxCache, dynamic_cache_bytes
    from kvcx.quality.bridge import cache_layers

    model, _, _ = loaded
    dyn = DynamicCache()
    with torch.inference_mode():
        model(wiki_ids[:, :4096], past_key_values=dyn, use_cache=True, logits_to_keep=1)
    kv = KvcxCache(model.config)
    for i, (k, v) in enumerate(cache_layers(dyn)):  # what the model's attention layers do during prefill
        kv.update(k, v, i)
    rep = kv.memory_report()
    fp32 = dynamic_cache_bytes(dyn)
    assert rep["tokens"] == 4096 and rep["model_dtype_equivalent_bytes"] == fp32
    fp16 = fp32 // 2
    assert rep["total_bytes"] <= 0.30 * fp16, rep
    assert rep["total_bytes"] <= 0.15 * fp32, rep
    layer = kv.layers[0]
    assert len(layer.store) and layer.store.keys.codes.dtype == np.uint8  # really packed, not dequantized copies
    assert layer.quantized_length == 4096 and layer.keys.shape[-2] == 0


def test_teacher_forced_agreement_and_generate(loaded, wiki_ids):
    from kvcx.cache.kvcx_cache import KvcxCache

    model, tok, _ = loaded
    prompt, steps = 1024, 32
    preds = {}
    for name, cache in (("dyn", DynamicCache()), ("kvcx", KvcxCache(model.config))):
        with torch.inference_mode():
            out = model(wiki_ids[:, :prompt], past_key_values=cache)
            p = [int(out.logits[0, -1].argmax())]
            for j in range(prompt, prompt + steps - 1):
                p.append(int(model(wiki_ids[:, j:j + 1], past_key_values=cache).logits[0, -1].argmax()))
        preds[name] = p
    assert cache.get_seq_length() == prompt + steps - 1
    agree = np.mean([a == b for a, b in zip(preds["dyn"], preds["kvcx"])])
    assert agree >= 0.9, agree
    with torch.inference_mode():
        g = model.generate(wiki_ids[:, :300], past_key_values=KvcxCache(model.config, residual_length=128),
                           max_new_tokens=12, do_sample=False)
    text = tok.decode(g[0, 300:])
    assert g.shape[1] == 312 and len(text.strip()) > 0


def test_batch_with_left_padding_matches_batch_one(loaded, wiki_ids):
    from kvcx.cache.kvcx_cache import KvcxCache

    model, tok, _ = loaded
    a = wiki_ids[0, :200]
    b = wiki_ids[0, 1000:1150]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = torch.full((2, 200), pad)
    batch[0] = a
    batch[1, 50:] = b
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :50] = 0
    with torch.inference_mode():
        gb = model.generate(batch, attention_mask=mask, past_key_values=KvcxCache(model.config, residual_length=64),
                            max_new_tokens=8, do_sample=False, pad_token_id=pad)
        g0 = model.generate(a[None], past_key_values=KvcxCache(model.config, residual_length=64),
                            max_new_tokens=8, do_sample=False, pad_token_id=pad)
        g1 = model.generate(b[None], past_key_values=KvcxCache(model.config, residual_length=64),
                            max_new_tokens=8, do_sample=False, pad_token_id=pad)
    assert gb[0, 200:].tolist() == g0[0, 200:].tolist()
    same = np.mean([x == y for x, y in zip(gb[1, 200:].tolist(), g1[0, 150:].tolist())])
    assert same >= 0.75, (gb[1, 200:].tolist(), g1[0, 150:].tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(loaded, wiki_ids, dtype):
    from kvcx.cache.kvcx_cache import KvcxCache

    model, _, _ = loaded
    cache = KvcxCache(model.config, residual_length=64)
    layers = model.config.num_hidden_layers
    rng = torch.Generator().manual_seed(0)
    for step in range(3):  # prefill of 130 tokens, then single tokens: packs, then decodes
        n = 130 if step == 0 else 1
        for i in range(layers):
            k = torch.randn(1, 3, n, 64, generator=rng).to(dtype)
            v = torch.randn(1, 3, n, 64, generator=rng).to(dtype)
            ko, vo = cache.update(k, v, i)
            assert ko.dtype == dtype and ko.shape[-2] == cache.layers[i].cumulative_length
    assert cache.layers[0].quantized_length == 128
    assert cache.layers[0].store.keys.chunk(0).dtype == ("BF16" if dtype == torch.bfloat16 else "F16")


def test_errors():
    from transformers import LlamaConfig

    from kvcx.cache.kvcx_cache import KvcxCache

    cfg = LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=2, hidden_size=32)
    with pytest.raises(KvcxError, match="residual_length \\(100\\) must be a multiple of the group size \\(64\\)"):
        KvcxCache(cfg, residual_length=100)
    with pytest.raises(ModelError, match="transformers 4.40.0 is older than kvcx needs"):
        check_transformers("4.40.0")
    check_transformers("99.0")   # a newer release runs: what kvcx uses is checked, not the version
    cache = KvcxCache(cfg)
    with pytest.raises(KvcxError, match="beam search"):
        cache.layers[0].reorder_cache(torch.tensor([0]))


def _copy_into(src, cache):
    from kvcx.quality.bridge import cache_layers

    for i, (k, v) in enumerate(cache_layers(src)):  # what the layers do with a prefill's keys and values
        cache.update(k.clone(), v.clone(), i)
    return cache


def _decode(model, cache, tokens, mask, positions):
    """Teacher-forced single-token steps; every layer's attention output and the logits of each step."""
    outs, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o: outs.append(o[0].detach().clone())))
    logits = []
    try:
        with torch.inference_mode():
            for j in range(tokens.shape[1]):
                mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
                positions = positions[:, -1:] + 1
                out = model(tokens[:, j:j + 1], attention_mask=mask, position_ids=positions, past_key_values=cache)
                logits.append(out.logits[:, -1].clone())
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(outs), torch.stack(logits)


@pytest.fixture
def checked_attention(kvcx_attention, checked):
    """The embedded model with kvcx's attention, every fused step checked (tests/cache/conftest.py's ``checked``)."""
    return checked


@pytest.mark.parametrize("scheme", ["kvcx", "reference", "kvcx3", "kvcx2", "plan:smollm2-kvcx2-3.54", "kvcx2w",
                                    "kvcx4w", "plan:smollm2-kvcx2w-2.47", "plan:smollm2-kvcx2v-2.12"])
def test_fused_attention_equals_materialised_every_layer_batch_with_left_padding(checked_attention, loaded,
                                                                                 wiki_ids, scheme):
    """A real 1,020-token context, batch 2 (row 1 left-padded by 60), 6 decode steps crossing a packing
    boundary. Every layer, every step: the fused kernel's attention output equals SDPA over the
    materialised cache (decoded to FP32) from the same query within FP32 rounding; end to end, the
    logits of a fused run and a materialising run agree to FP32 rounding amplified by 30 layers."""
    from kvcx.cache.kvcx_cache import KvcxCache

    model, tok, _ = loaded
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n, padn, steps = 1020, 60, 6
    ids = torch.full((2, n + steps), pad)
    ids[0] = wiki_ids[0, :n + steps]
    ids[1, padn:] = wiki_ids[0, 2000:2000 + n + steps - padn]
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :padn] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    base = DynamicCache()
    with torch.inference_mode():
        model(ids[:, :n], attention_mask=mask, position_ids=positions, past_key_values=base)
    kw = dict(kv_config=load_plan(scheme[5:])) if scheme.startswith("plan:") else dict(scheme=scheme)
    fused = _copy_into(base, KvcxCache(model.config, fused=True, **kw))
    mat = _copy_into(base, KvcxCache(model.config, fused=False, **kw))
    a_f, l_f = _decode(model, fused, ids[:, n:], mask, positions)
    a_m, l_m = _decode(model, mat, ids[:, n:], mask, positions)
    layers = model.config.num_hidden_layers
    steps_f, steps_m = fused.memory_report()["attention_steps"], mat.memory_report()["attention_steps"]
    assert steps_f["fused"] == steps * layers and steps_f["materialised"] == 0, steps_f
    assert steps_m["fused"] == 0 and steps_m["materialised"] == steps * layers, steps_m
    assert fused.layers[0].quantized_length == mat.layers[0].quantized_length == 1024  # packed mid-way
    assert len(checked_attention) == steps * layers
    assert sorted({r[0] for r in checked_attention}) == list(range(layers))
    worst = max(checked_attention, key=lambda r: r[1] / r[2])
    assert worst[1] <= 1e-5 * worst[2], worst  # FP32 rounding, every layer and step
    assert a_f.shape == (steps * layers, 2, 1, model.config.hidden_size)
    assert (l_f - l_m).abs().max() <= 1e-2, (l_f - l_m).abs().max()


@pytest.mark.parametrize("scheme", ["kvcx", "reference", "kvcx2", "kvcx2w"])
def test_multi_token_steps_fused_equal_materialised_batch_with_left_padding(checked_attention, loaded, wiki_ids,
                                                                            scheme):
    """A 1,020-token context packed, batch 2 (row 1 left-padded by 60), then chunks of 40 and 7 tokens (a long
    prompt fed in chunks; a draft verified) and one decode step: every layer's multi-token attention equals
    SDPA over the materialised cache with the same causal mask within FP32 rounding."""
    from kvcx.cache.kvcx_cache import KvcxCache

    model, tok, _ = loaded
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n, padn, chunks = 1020, 60, (40, 7, 1)
    ids = torch.full((2, n + sum(chunks)), pad)
    ids[0] = wiki_ids[0, :n + sum(chunks)]
    ids[1, padn:] = wiki_ids[0, 2000:2000 + n + sum(chunks) - padn]
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :padn] = 0
    base = DynamicCache()
    with torch.inference_mode():
        model(ids[:, :n], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=base)
    logits = {}
    for fused in (True, False):
        cache = _copy_into(base, KvcxCache(model.config, scheme=scheme, fused=fused))
        m, o, out = mask, n, []
        with torch.inference_mode():
            for c in chunks:
                m = torch.cat([m, torch.ones(2, c, dtype=m.dtype)], dim=1)
                pos = (m.cumsum(-1) - 1)[:, -c:]
                out.append(model(ids[:, o:o + c], attention_mask=m, position_ids=pos, past_key_values=cache).logits)
                o += c
        logits[fused] = torch.cat(out, dim=1)
        steps = cache.memory_report()["attention_steps"]
        layers = model.config.num_hidden_layers
        if fused:
            assert steps == {"fused": 3 * layers, "materialised": 0, "full_precision": layers}, steps  # the copy
            records = list(checked_attention)
        else:
            assert steps["materialised"] == 3 * layers, steps
    assert len(records) == 3 * layers and sorted({r[0] for r in records}) == list(range(layers))
    worst = max(records, key=lambda r: r[1] / r[2])
    assert worst[1] <= 1e-5 * worst[2], worst
    assert (logits[True] - logits[False]).abs().max() <= 1e-2


def test_speculative_decoding_verifies_drafts_fused_and_crops(kvcx_attention, loaded, wiki_ids):
    """generate() with prompt-lookup drafts: the model verifies several draft tokens per step (fused multi-token
    steps) and crop() drops the rejected ones; the tokens equal the materialising path's and plain greedy
    decoding's with the same cache; nothing of context size is decoded into full precision."""
    from kvcx.cache.kvcx_cache import KvcxCache

    model, _, _ = loaded
    prompt, new = wiki_ids[:, :600], 24
    layers = model.config.num_hidden_layers
    with torch.inference_mode():
        fused = KvcxCache(model.config)
        g_f = model.generate(prompt, past_key_values=fused, max_new_tokens=new, do_sample=False,
                             prompt_lookup_num_tokens=5)
        mat = KvcxCache(model.config, fused=False)
        g_m = model.generate(prompt, past_key_values=mat, max_new_tokens=new, do_sample=False,
                             prompt_lookup_num_tokens=5)
        g_g = model.generate(prompt, past_key_values=KvcxCache(model.config), max_new_tokens=new, do_sample=False)
    rep = fused.memory_report()
    steps = rep["attention_steps"]
    assert steps["materialised"] == 0 and 0 < steps["fused"] < (new - 1) * layers, steps  # several tokens a step
    assert rep["scratch_bytes"] < 2 ** 16   # the last step's mask: nothing of context size in full precision
    assert fused.get_seq_length() == mat.get_seq_length() == 600 + new - 1
    assert g_f.tolist() == g_m.tolist() == g_g.tolist()


def test_crop_drops_only_full_precision_tokens(loaded):
    from kvcx.cache.kvcx_cache import KvcxCache

    model = loaded[0]
    cfg = model.config
    cache = KvcxCache(cfg)
    k = torch.randn(1, cfg.num_key_value_heads, 130, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        cache.update(k[:, :, :128], k[:, :, :128].clone(), i)   # a prompt chunk: packed at once
    assert cache.layers[0].quantized_length == 128 and cache.get_seq_length() == 128
    with pytest.raises(KvcxError, match="only the last 0 are still in full precision"):
        cache.crop(-1)
    for i in range(cfg.num_hidden_layers):
        cache.update(k[:, :, 128:], k[:, :, 128:].clone(), i)   # 2 draft tokens: kept for crop()
    cache.crop(-1)
    assert cache.get_seq_length() == 129 and cache.layers[0].keys.shape[-2] == 1
    cache.crop(0)
    with pytest.raises(KvcxError, match="negative count"):
        cache.crop(5)


def test_generate_uses_the_fused_path(kvcx_attention, loaded, wiki_ids):
    import warnings

    from kvcx.cache.kvcx_cache import KvcxCache
    from kvcx.errors import SlowPathWarning

    model, _, _ = loaded
    prompt, new = wiki_ids[:, :300], 12
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)   # nothing to tell on the fused path
        fused = KvcxCache(model.config)
        g_f = model.generate(prompt, past_key_values=fused, max_new_tokens=new, do_sample=False)
        mat = KvcxCache(model.config, fused=False)
        g_m = model.generate(prompt, past_key_values=mat, max_new_tokens=new, do_sample=False)
    rep = fused.memory_report()
    layers = model.config.num_hidden_layers
    assert rep["attention_steps"] == {"fused": (new - 1) * layers, "materialised": 0, "full_precision": layers}
    assert rep["scratch_bytes"] == 0  # nothing proportional to the context kept in full precision
    assert mat.memory_report()["attention_steps"]["materialised"] == (new - 1) * layers
    assert g_f.tolist() == g_m.tolist()


def _reachable_bytes(root) -> int:
    """Bytes of every NumPy array and torch tensor reachable from root (each buffer counted once)."""
    import gc

    seen, buffers, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            buffers[("np", base.__array_interface__["data"][0])] = base.nbytes
            continue
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            buffers[("t", st.data_ptr())] = st.nbytes()
            continue
        if isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("transformers.models"):
            continue
        stack.extend(gc.get_referents(obj))
    return sum(buffers.values())


def test_memory_held_after_decode_steps_counted_whole(kvcx_attention, loaded, wiki_ids):
    """4,000-token prompt + 64 fused decode steps: everything reachable from the cache (packed stores,
    residual, head rows, workspace, any scratch) <= 0.30x an FP16 DynamicCache of the same tokens, and
    memory_report()'s total_bytes counts all of it."""
    from kvcx.cache.kvcx_cache import KvcxCache

    model, _, _ = loaded
    cache = KvcxCache(model.config)
    with torch.inference_mode():
        out = model(wiki_ids[:, :4000], past_key_values=cache, logits_to_keep=1)
        tok_ = out.logits[:, -1:].argmax(-1)
        for _ in range(64):
            tok_ = model(tok_, past_key_values=cache).logits[:, -1:].argmax(-1)
    rep = cache.memory_report()
    assert rep["tokens"] == 4064 and rep["attention_steps"]["fused"] == 64 * model.config.num_hidden_layers
    cfg = model.config
    fp16 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 4064 * cfg.head_dim * 2
    reach = _reachable_bytes(cache)
    assert reach <= rep["total_bytes"], (reach, rep)
    assert rep["total_bytes"] <= 0.30 * fp16, (rep["total_bytes"] / fp16, rep)


def test_fused_true_needs_the_kvcx_attention(loaded):
    from kvcx.cache.kvcx_cache import KvcxCache

    model, _, _ = loaded
    assert model.config._attn_implementation != "kvcx"
    with pytest.raises(KvcxError, match="set_attn_implementation\\('kvcx'\\)"):
        with torch.inference_mode():
            cache = KvcxCache(model.config, fused=True)
            model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
            model(torch.tensor([[4]]), past_key_values=cache)
    with pytest.raises(KvcxError, match="fused must be None"):
        KvcxCache(model.config, fused="yes")


def test_told_once_how_to_turn_the_fused_path_on(loaded, wiki_ids):
    import warnings

    from kvcx.cache.kvcx_cache import KvcxCache
    from kvcx.errors import SlowPathWarning

    model, _, _ = loaded
    assert model.config._attn_implementation == "sdpa"
    prompt = wiki_ids[:, :100]

    def told(cache, new=4):
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
            warnings.simplefilter("always")
            model.generate(prompt, past_key_values=cache, max_new_tokens=new, do_sample=False)
        assert cache.memory_report()["attention_steps"]["fused"] == 0
        return [str(w.message) for w in caught if issubclass(w.category, SlowPathWarning)]

    msgs = told(KvcxCache(model.config))
    assert len(msgs) == 1, msgs   # once, at the first decode step, not per layer or step
    assert "'sdpa'" in msgs[0] and "model.set_attn_implementation('kvcx')" in msgs[0]
    assert told(KvcxCache(model.config, fused=False)) == []   # materialising on purpose
    assert len(told(KvcxCache(model.config, scheme="kvcx2w"))) == 1   # widths are fused too
    assert told(KvcxCache(model.config, scheme="q4_0")) == []   # the kernel cannot read it: no false hope


def test_kvcx_cache_honours_n_threads_for_every_chunk():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from kvcx.cache.kvcx_cache import KvcxCache

    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=128)
    for cache in (KvcxCache(cfg, n_threads=1), KvcxCache(cfg, kv_config=KVConfig.from_scheme(), n_threads=1)):
        layer = cache.layers[0]
        assert all(c.n_threads == 1 for c in layer._codecs_next.values())
        assert layer.n_threads == 1
        k = torch.randn(1, 2, 256, 64)
        cache.update(k, k.clone(), 0)
        cache.update(k[:, :, :128], k[:, :, :128].clone(), 0)
        assert len(layer.store) == 2


@pytest.mark.model
def test_kvcx_cache_with_presets_and_a_plan(loaded, wikitext_path):
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    from kvcx.cache.kvcx_cache import KvcxCache

    model, tok, _ = loaded
    ids = torch.tensor(tok(wikitext_path.read_text(encoding="utf-8")[:8000])["input_ids"][:300])[None]
    n_layers = model.config.num_hidden_layers
    plan = plan_config("kvcx2", layer_bits=[(L, 4, 4) for L in range(0, n_layers, 2)])
    with torch.inference_mode():
        ref = model(ids, past_key_values=DynamicCache()).logits[0, -1]
        for cfg in (KVConfig.from_scheme("kvcx3"), KVConfig.from_scheme("kvcx2"), plan):
            cache = KvcxCache(model.config, kv_config=cfg)
            model(ids[:, :256], past_key_values=cache)
            logits = model(ids[:, 256:], past_key_values=cache).logits[0, -1]
            layer0, layer1 = cache.layers[0], cache.layers[1]
            want0 = 4 if cfg is plan else cfg.key.bits
            assert layer0.store.keys.chunk(0).config["bits"] == want0
            assert layer1.store.keys.chunk(0).config["bits"] == cfg.key.bits
            assert layer0.store.keys.chunk(0).codes.nbytes * cfg.key.bits == \
                layer1.store.keys.chunk(0).codes.nbytes * want0
            cos = torch.nn.functional.cosine_similarity(ref, logits, dim=0)
            assert cos > 0.9, (cfg.describe(), float(cos))
        g = model.generate(ids[:, :200], past_key_values=KvcxCache(model.config, kv_config=plan),
                           max_new_tokens=6, do_sample=False)
        assert g.shape[1] == 206
        # the shipped plan (README): keys in groups of 128 tokens and asymmetric values with their sinks
        shipped = load_plan("smollm2-kvcx2-3.54")   # a shipped plan, by name
        sel = {L: (kb, vb) for L, kb, vb in shipped.layer_bits}
        L = next(L for L, (kb, vb) in sel.items() if (kb, vb) == ("b3g128", "b3a"))
        cache = KvcxCache(model.config, kv_config=shipped)
        model(ids[:, :256], past_key_values=cache)
        logits = model(ids[:, 256:], past_key_values=cache).logits[0, -1]
        kc, vc = (getattr(cache.layers[L].store, k).chunk(0).config for k in ("keys", "values"))
        assert (kc["bits"], kc["group_size"], vc["bits"], vc["scheme"], vc["sinks"]) == (3, 128, 3, "asymmetric", 1)
        cos = torch.nn.functional.cosine_similarity(ref, logits, dim=0)
        assert cos > 0.95, float(cos)
        # decoding past a residual flush (64 tokens) appends chunks to the g128 keys
        g = model.generate(ids[:, :250], past_key_values=KvcxCache(model.config, kv_config=shipped),
                           max_new_tokens=80, do_sample=False)
    assert g.shape[1] == 330


@pytest.mark.model
def test_kvcx2w_in_kvcx_cache_and_calibrated_query_weights(loaded, wikitext_path, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    from kvcx.api import save_plan
    from kvcx.cache.kvcx_cache import KvcxCache
    from kvcx.codecs import WidthCodec
    from kvcx.quality import calibrate as cal

    model, tok, _ = loaded
    n = model.config.num_hidden_layers
    # one width to measure (each layer's keys at 2 bits): the queries' weights are what this test is about
    res = cal.run_calibration(KVConfig.from_scheme("kvcx2w"), budget=2.5, dataset_file=wikitext_path, windows=1,
                              offset=3, window=192, stride=64, loaded=loaded, options=["b2w"])
    plan = res.config
    assert isinstance(plan.key, WidthCodec) and plan.key.bits == 2.0 and len(plan.key_weights) == n
    w = np.asarray(plan.key_weights[0][1])
    assert w.shape == (model.config.num_key_value_heads, 64) and (w > 0).all()
    np.testing.assert_allclose(w[:, :32], w[:, 32:], rtol=1e-5)   # the rotary pairs share a weight
    save_plan(tmp_path / "w.json", res)
    assert load_plan(tmp_path / "w.json") == plan
    ids = torch.tensor(tok(wikitext_path.read_text(encoding="utf-8")[:8000])["input_ids"][:300])[None]
    with torch.inference_mode():
        ref = model(ids, past_key_values=DynamicCache()).logits[0, -1]
        for cfg in (KVConfig.from_scheme("kvcx2w"), plan):
            cache = KvcxCache(model.config, kv_config=cfg)
            model(ids[:, :256], past_key_values=cache)
            logits = model(ids[:, 256:], past_key_values=cache).logits[0, -1]
            chunk = cache.layers[1].store.keys.chunk(0)
            assert chunk.config["id"] == "kvcx.widths" and cache.memory_report()["attention_steps"]["fused"] == 0
            cos = torch.nn.functional.cosine_similarity(ref, logits, dim=0)
            assert cos > 0.9, (cfg.describe(), float(cos))
        # generation past a residual flush appends chunks of keys whose widths each chunk chooses
        g = model.generate(ids[:, :250], past_key_values=KvcxCache(model.config, kv_config=plan),
                           max_new_tokens=80, do_sample=False)
    assert g.shape[1] == 330


@pytest.mark.model
def test_kvcx2v_in_kvcx_cache(kvcx_attention, loaded, wiki_ids):
    """kvcx2v (E8P values, keys with a width per channel in groups of 64 tokens) in KvcxCache: the residual defaults to
    the keys' groups, the cache's logits stay close to DynamicCache's through a residual flush, and the steps run fused
    (the kernel reads the E8P records), with the logits of the materialising path that decodes them."""
    from kvcx.cache.kvcx_cache import KvcxCache

    model, _, _ = loaded
    ids = wiki_ids[:, :300]
    with torch.inference_mode():
        ref = model(ids, past_key_values=DynamicCache()).logits[0, -40:]
        cache = KvcxCache(model.config, scheme="kvcx2v")
        model(ids[:, :260], past_key_values=cache)
        logits = model(ids[:, 260:], past_key_values=cache).logits[0]
    assert cache.layers[0].store.keys.chunk(0).config["id"] == "kvcx.widths"
    assert cache.layers[0].store.values.chunk(0).config == {"id": "kvcx.e8p", "sinks": 1}
    cos = torch.nn.functional.cosine_similarity(ref, logits, dim=-1)
    assert float(cos.mean()) > 0.98 and float((ref.argmax(-1) == logits.argmax(-1)).float().mean()) >= 0.8
    report = cache.memory_report()
    assert report["attention_steps"]["fused"] > 0 and report["attention_steps"]["materialised"] == 0
    with torch.inference_mode():
        slow = KvcxCache(model.config, scheme="kvcx2v", fused=False)
        model(ids[:, :260], past_key_values=slow)
        decoded = model(ids[:, 260:], past_key_values=slow).logits[0]
    assert slow.memory_report()["attention_steps"]["fused"] == 0
    assert float((logits - decoded).abs().max()) < 2e-3 * float(decoded.abs().max())
    g = model.generate(wiki_ids[:, :110], past_key_values=KvcxCache(model.config, scheme="kvcx2v"),
                       max_new_tokens=30, do_sample=False)   # past the first flush of the 128-token residual
    assert g.shape[1] == 140
