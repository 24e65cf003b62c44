"""KvcxCache on every model family of 2026, each built from transformers' own config class (tiny, seeded random
weights, no download: bench/families.py): a prompt of 8x the window (the window's ring wraps 8 times), then 16
greedy tokens, at batch 1 and as a left-padded batch of 3, against DynamicCache(config=...) with the model's eager
attention (what softcapping and sinks need).

What is asserted, for each family and batch:
- every decode step of every full, sliding and chunked layer runs fused (memory_report's counts), and each fused
  step's attention equals the reference attention over the same layer's context decoded, from the same queries,
  within FP32 rounding (MLA: every step materialised, the reason stated);
- a sliding or chunked layer holds at most its window, one packed chunk and the residual, 8 windows in;
- with 8-bit codes the greedy tokens are DynamicCache's, wherever DynamicCache's top-1 leads by more than the
  8-bit logits' own error (twice the largest logit difference: a random model's near-ties are the only exception,
  and they are at most 10 % of the tokens);
- with the default scheme the next-token distributions, teacher-forced on DynamicCache's tokens, are within
  KL 0.003 nats of DynamicCache's on average: the default scheme's KLD on the embedded (real) model over WikiText
  (docs/results/quality.md, 0.0031), i.e. a random family model is no further from its exact cache than a real
  model is. (Gemma 4 is built with its trained attention temperature: bench/families.temper says why.)
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from bench.families import build, decode, decoded_caches, family_configs, kl, prompts, temper  # noqa: E402
from kvcx.cache import KvcxCache, StaticKvcxCache  # noqa: E402

WINDOW, STEPS = 64, 16
PROMPT = 8 * WINDOW
FAMILIES = family_configs(WINDOW, PROMPT)
KL_BOUND = 0.003
STATIC_STEPS = 4   # decode steps of StaticKvcxCache's families (Triton's interpreter on a CPU: about a second each)


def _model(name):
    cfg = FAMILIES[name]()
    cfg.eos_token_id = None   # 16 tokens whatever the random model says
    return temper(build(cfg), name)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_generates_fused_within_its_window_and_close_to_dynamic_cache(name, batch, checked):
    model = _model(name)
    ids, mask = prompts(batch, PROMPT)
    model.set_attn_implementation("eager")
    ref_tokens, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, STEPS)
    model.set_attn_implementation("kvcx")

    cache = KvcxCache(model.config)
    _, logits = decode(model, cache, ids, mask, STEPS, forced=ref_tokens)
    report = cache.memory_report()
    packed = [s for s in cache.specs if s.packed]
    steps = report["attention_steps"]
    if all(s.latent for s in packed):   # MLA: the model expands the latent after the cache
        assert steps["fused"] == 0 and steps["materialised"] == (STEPS - 1) * len(packed)
        assert all("MLA" in r["fused_unsupported"] for r in report["layers"])
    else:
        assert steps["materialised"] == 0, steps
        shared = getattr(model.config.get_text_config(), "num_kv_shared_layers", 0) or 0   # they attend too
        assert steps["fused"] == (STEPS - 1) * (len(packed) + shared), steps
        assert len(checked) == steps["fused"]
        worst = max(checked, key=lambda r: r[1] / r[2])
        assert worst[1] <= 2e-5 * worst[2], worst   # FP32 rounding, every layer and step
    for spec, layer in zip(cache.specs, report["layers"]):
        if spec.window:   # the window, one packed chunk and the residual, 8 windows in
            assert layer["tokens_held"] <= spec.window + 2 * cache.residual_length, layer
    divergence = kl(ref_logits, logits)
    assert divergence <= KL_BOUND, divergence

    cache8 = KvcxCache(model.config, bits=8)
    _, logits8 = decode(model, cache8, ids, mask, STEPS, forced=ref_tokens)
    top2 = ref_logits.topk(2, dim=-1).values
    lead = top2[..., 0] - top2[..., 1]
    noise = (logits8 - ref_logits).abs().amax(-1)
    decided = lead > 2 * noise
    assert bool((logits8.argmax(-1) == ref_tokens)[decided].all())
    assert float(decided.float().mean()) >= 0.9, int((~decided).sum())   # near-ties: at most 10 % of the tokens


STATIC_FAMILIES = [n for n in FAMILIES if n not in ("Qwen3", "Qwen3-MoE", "Phi-3")]


@pytest.mark.parametrize("name", STATIC_FAMILIES)
def test_static_cache_packs_every_family_with_its_decode_steps_on_the_device(name):
    """StaticKvcxCache (the Triton kernels; their interpreter on a CPU) on each family (of the full-attention
    families Llama alone: the others' layers are of the same kind, tested further in
    tests/cache/test_static_cache.py), batch 1 (it takes rows of equal length): the prompt of 8x the window, then
    4 steps teacher-forced on DynamicCache's tokens. Every full, sliding, chunked and MLA layer is packed (linear
    ones kept in transformers' class) and runs its decode steps on the device (MLA: its rows decoded there, attended
    with kv_b_proj absorbed); a windowed layer holds a ring of its
    window (64 tokens: whole tiles of the kernel), not the context; the next-token distributions are within the
    default scheme's KL bound of DynamicCache's."""
    model = _model(name)
    ids, mask = prompts(1, PROMPT)
    model.set_attn_implementation("eager")
    ref_tokens, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, STATIC_STEPS)
    model.set_attn_implementation("kvcx")
    cache = StaticKvcxCache(model.config, max_cache_len=PROMPT + STATIC_STEPS)
    _, logits = decode(model, cache, ids, mask, STATIC_STEPS, forced=ref_tokens)
    report = cache.memory_report()
    packed = [s for s in cache.specs if s.packed]
    assert [r["kvcx"] for r in report["layers"]] == ["packed" if s.packed else "kept" for s in cache.specs]
    assert report["attention_steps"]["device"] == (STATIC_STEPS - 1) * len(packed), report["attention_steps"]
    for spec, layer in zip(cache.specs, cache.layers):
        if spec.window:
            assert layer.pool.page_tokens == WINDOW and layer.res_k.shape[2] == cache.residual_length
    divergence = kl(ref_logits, logits)
    assert divergence <= KL_BOUND, divergence


def test_kv_shared_layers_attend_over_their_owners_packed_store():
    """Gemma 4 with KV sharing: the last 3 layers read the last cache layer of their type; fused, each shared
    layer's step attends over its owner's packed store with its own queries (twice the fused steps), and the
    materialised path hands them buffers of their own (8-bit: DynamicCache's distributions within FP32 noise)."""
    import transformers as T

    from bench.families import _common

    cfg = T.Gemma4TextConfig(**{**_common(WINDOW, PROMPT), "num_hidden_layers": 6}, sliding_window=WINDOW,
                             global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                             hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, num_kv_shared_layers=3,
                             layer_types=["sliding_attention"] * 2 + ["full_attention"]
                             + ["sliding_attention"] * 2 + ["full_attention"])
    cfg.eos_token_id = None
    model = temper(build(cfg), "Gemma 4")
    ids, mask = prompts(1, PROMPT)
    model.set_attn_implementation("eager")
    ref_tokens, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, 8)
    model.set_attn_implementation("kvcx")
    cache = KvcxCache(model.config)
    _, logits = decode(model, cache, ids, mask, 8, forced=ref_tokens)
    assert len(cache.packed_layers) == 3 and cache.memory_report()["attention_steps"]["fused"] == 7 * 6
    assert len(cache.layers) == len(DynamicCache(config=model.config).layers)   # 3, or 6 with 5.2x's placeholders
    assert kl(ref_logits, logits) <= KL_BOUND
    _, logits8 = decode(model, KvcxCache(model.config, bits=8), ids, mask, 8, forced=ref_tokens)
    assert kl(ref_logits, logits8) <= 1e-4


def test_unsupported_layers_kept_the_others_packed_and_fused():
    """DeepSeek V4: its compressed-attention layers stay in transformers' own classes (unsupported='keep'), its
    sliding layers are packed and fused; the model runs end to end."""
    from bench.families import unsupported_config

    cfg = unsupported_config(WINDOW, PROMPT)
    cfg.eos_token_id = None
    model = build(cfg)
    ids, mask = prompts(1, PROMPT)
    model.set_attn_implementation("kvcx")
    cache = KvcxCache(model.config, unsupported="keep")
    tokens, _ = decode(model, cache, ids, mask, 8)
    report = cache.memory_report()
    assert tokens.shape == (1, 8) and report["attention_steps"]["fused"] == 7 * 2
    assert report["kept_bytes"] > 0 and [r["kvcx"] for r in report["layers"]] == ["packed", "kept", "packed", "kept"]


def test_eager_only_model_attends_as_its_eager_attention():
    """DeepSeek V4 runs eager attention only and its compressed layers (left to its own code) concatenate the
    compressor's additive bias (0 / -inf) onto the mask: the "kvcx" attention hands such a model eager's float mask (a
    boolean one would read the bias inverted), so with DynamicCache it gives eager's tokens exactly, and KvcxCache at 8
    bits (compressed layers kept) gives them too. GPT-OSS, eager-only with every layer packed, keeps SDPA's mask:
    none on an unpadded decode step (what StaticKvcxCache needs)."""
    from kvcx.cache.attention_fn import _model_code_reads_mask

    assert not _model_code_reads_mask(FAMILIES["GPT-OSS"]()) and not _model_code_reads_mask(FAMILIES["Llama"]())
    from bench.families import unsupported_config

    cfg = unsupported_config(WINDOW, PROMPT)
    cfg.eos_token_id = None
    assert _model_code_reads_mask(cfg)
    model = build(cfg)
    ids, mask = prompts(1, PROMPT)
    model.set_attn_implementation("eager")
    ref_tokens, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, 8)
    model.set_attn_implementation("kvcx")
    tokens, logits = decode(model, DynamicCache(config=model.config), ids, mask, 8)
    assert torch.equal(tokens, ref_tokens) and torch.allclose(logits, ref_logits, atol=1e-4)
    tokens8, _ = decode(model, KvcxCache(model.config, unsupported="keep", bits=8), ids, mask, 8)
    assert torch.equal(tokens8, ref_tokens)


MEMORY_WINDOW = 256   # the setting: a 2,048-token prompt, 8x the window


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("Llama", "Qwen3", "Qwen3-MoE", "Phi-3",
                                                                     "DeepSeek V3 (MLA)")])
def test_memory_held_at_8x_the_window_against_dynamic_cache(name):
    """Sliding, chunked and linear hybrids in BF16 (both caches in the model's dtype: DynamicCache's bytes are its
    FP16-equivalent bytes), 8x a 256-token window in, 4 tokens generated: KvcxCache holds every byte it keeps
    (packed, residual, transformers' kept states, scratch, workspace) in at most 0.45x what DynamicCache(config=...)
    holds, whose sliding layers keep their window too (like with like)."""
    from kvcx.cache.kvcx_cache import dynamic_cache_bytes

    cfg = family_configs(MEMORY_WINDOW, 8 * MEMORY_WINDOW)[name]()
    cfg.eos_token_id = None
    model = temper(build(cfg, dtype=torch.bfloat16), name)
    ids, mask = prompts(1, 8 * MEMORY_WINDOW)
    dynamic, cache = decoded_caches(model, ids, mask, 4)
    held = cache.memory_report()["total_bytes"]
    assert held <= 0.45 * dynamic_cache_bytes(dynamic), (held, dynamic_cache_bytes(dynamic))


def test_attention_branch_reads_what_each_layer_adds():
    """bench/families.attention_branch (the families page's table of where the error enters): for every decoder
    layer the residual stream entering it and what its attention adds; Gemma normalizes its attention's output before
    the sum (a post_attention_layernorm beside a pre_feedforward_layernorm), so what it adds is that norm's output,
    of unit rms at init, while Llama adds its attention module's output as it is."""
    from bench.families import attention_branch

    ids, mask = prompts(1, 96)
    gemma = attention_branch(_model("Gemma 3"), ids, mask)
    llama = attention_branch(_model("Llama"), ids, mask)
    for got in (gemma, llama):
        assert sorted(got) == [0, 1, 2, 3]
        assert all(x["residual"] > 0 and x["branch"] > 0 for x in got.values())
    assert all(abs(x["branch"] - 1.0) < 0.05 for x in gemma.values())
    assert all(x["branch"] < 0.5 for x in llama.values())
