"""The gate on hybrid models: prefix, generation and engine modes run on models with sliding-window, chunked,
linear-attention and latent (MLA) layers (tiny random-weight models from transformers' config classes, with the embedded model's
tokenizer), compress what an engine compresses (every attention layer's keys and values, the sliding layers' window
included; linear attention's states kept; MLA's latent with the keys' codec, its RoPE key as KvcxCache codes it) and
score the same tokens as the exact cache."""
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvcx.codecs import KVConfig  # noqa: E402
from kvcx.quality.scoring import identity_roundtrip  # noqa: E402
from kvcx.quality.validation import run_validation  # noqa: E402


def _hybrid(kind, vocab):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    if kind == "sliding":
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=128,
                                            layer_types=["sliding_attention"] * 3 + ["full_attention"])
    elif kind == "chunked":   # Llama 4's text model: chunked attention (its get_decoder() is the LM itself)
        cfg = transformers.Llama4TextConfig(**common, attention_chunk_size=128, num_local_experts=2,
                                            intermediate_size_mlp=96, no_rope_layers=[1, 1, 1, 0],
                                            layer_types=["chunked_attention"] * 3 + ["full_attention"])
    elif kind == "mla":   # DeepSeek V3's latent attention: a latent of 64 and a RoPE key of 32 a layer
        mla = {k: v for k, v in common.items() if k != "head_dim"}   # its RoPE runs over qk_rope_head_dim
        cfg = transformers.DeepseekV3Config(**{**mla, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=64,
                                            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                                            first_k_dense_replace=4, n_routed_experts=2, num_experts_per_tok=1)
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                             linear_value_head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kind", ["sliding", "linear", "chunked", "mla"])
def test_every_mode_gates_a_hybrid_model(loaded, wikitext_path, kind):
    _, tok, _ = loaded
    model = _hybrid(kind, len(tok))
    hybrid = (model, tok, f"tiny {kind} hybrid")
    exact = run_validation(KVConfig.from_scheme(), dataset_file=wikitext_path, max_windows=2, loaded=hybrid,
                           roundtrip=identity_roundtrip, window=512, stride=256)
    assert exact.delta == 0.0 and exact.kld == 0.0 and exact.top1_agreement == 1.0
    for mode in ("prefix", "generation", "engine"):
        r = run_validation(KVConfig.from_scheme(), dataset_file=wikitext_path, max_windows=2, loaded=hybrid,
                           mode=mode, window=512, stride=256)
        assert r.tokens_scored == 2 * 255 and r.baseline_perplexity == pytest.approx(exact.baseline_perplexity, rel=1e-6)
        assert math.isfinite(r.compressed_perplexity) and r.compressed_perplexity != r.baseline_perplexity, mode
        # a random model's next-token distribution is near uniform: its top-1 flips on noise, the KLD does not
        assert 0.0 < r.kld < 0.01 and r.top1_agreement > 0.5, (mode, r.kld, r.top1_agreement)
        if kind == "mla":   # the RoPE key (the cache's values) coded as KvcxCache codes it, in every mode
            assert r.config["latent_layers"] == [0, 1, 2, 3], mode
            if mode != "generation":   # (generation mode counts the cache whole: its residual in FP32 too)
                # the latent's 64 channels at the default's 4.375 bits, the RoPE key's 32 at 8.25, and the sinks
                assert 5.6 < r.bits_per_value < 6.6, (mode, r.bits_per_value)


def test_an_mla_models_cache_rebuilt_from_tensors_of_two_widths():
    """The prefix mode's compressed copy of an MLA cache: keys (the latent) and values (the RoPE key) of different
    widths make a layer; batch, heads or tokens that differ are refused with the layer named."""
    import numpy as np

    from kvcx.errors import KvcxError
    from kvcx.quality.bridge import tensors_to_layers

    t = {"layer_0_key": np.zeros((1, 1, 8, 64), np.float32), "layer_0_value": np.ones((1, 1, 8, 32), np.float32)}
    (k, v), = tensors_to_layers(t)
    assert tuple(k.shape) == (1, 1, 8, 64) and tuple(v.shape) == (1, 1, 8, 32) and float(v.sum()) == 256.0
    t["layer_0_value"] = np.ones((1, 1, 7, 32), np.float32)
    with pytest.raises(KvcxError, match="layer 0: key .* differ in batch, heads or tokens"):
        tensors_to_layers(t)


@pytest.mark.parametrize("kind", ["sliding", "linear"])
def test_calibrate_plans_a_hybrids_attention_layers_by_type(loaded, wikitext_path, kind):
    """kvcx calibrate on a hybrid measures and plans the layers whose keys and values the cache holds (linear
    attention's states have none), names each with its layer type in the plan, counts the plan's bits over them;
    the plan file reads back (reallocated), gates the model and runs in KvcxCache; query weights (kvcx2w) are
    taken from the same layers; a press, which plans every layer's tokens, is refused before the model runs."""
    import json

    from kvcx.cache.kvcx_cache import KvcxCache
    from kvcx.codecs.plan_record import check_plan_record
    from kvcx.presses import parse_press
    from kvcx.errors import KvcxError
    from kvcx.quality.calibrate import reallocate, run_calibration

    _, tok, _ = loaded
    model = _hybrid(kind, len(tok))
    hybrid = (model, tok, f"tiny {kind} hybrid")
    want = ((0, "sliding_attention"), (1, "sliding_attention"), (2, "sliding_attention"), (3, "full_attention")) \
        if kind == "sliding" else ((3, "full_attention"),)
    kw = dict(dataset_file=wikitext_path, windows=1, offset=0, window=256, stride=128, loaded=hybrid)
    cal = run_calibration(KVConfig.from_scheme("kvcx3"), 3.0, **kw)
    assert cal.layer_types == want and cal.layer_indices == [L for L, _ in want] and cal.n_layers == 4
    assert {L for _, L, _ in cal.sensitivity} == {L for L, _ in want}
    assert {L for L, _, _ in cal.config.layer_bits} <= {L for L, _ in want}
    assert cal.bits_per_value == pytest.approx(cal.config.bits_per_value(cal.layer_indices)) and cal.bits_per_value <= 3.0
    saved = json.loads(json.dumps(cal.to_dict()))
    assert saved["layers"] == [{"layer": L, "type": t} for L, t in want]
    check_plan_record(saved, "plan.json")
    again = reallocate(saved, 3.0)
    assert again.layer_types == want and again.config == cal.config and again.bits_per_value == cal.bits_per_value
    r = run_validation(cal.config, dataset_file=wikitext_path, max_windows=1, loaded=hybrid, window=256, stride=128)
    assert r.tokens_scored == 127 and 0.0 < r.kld < 0.01
    import kvcx.cache  # noqa: F401  (registers the "kvcx" attention implementation)

    model.set_attn_implementation("kvcx")
    cache = KvcxCache(model.config, kv_config=cal.config)
    ids = torch.randint(3, len(tok), (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    rep = cache.memory_report()
    assert out.shape == (1, 304) and [r["kvcx"] for r in rep["layers"]].count("packed") == len(want)
    assert rep["attention_steps"]["fused"] == 3 * len(want) and rep["attention_steps"]["materialised"] == 0
    widths = run_calibration(KVConfig.from_scheme("kvcx2w"), 2.6, **kw)
    assert [L for L, _ in widths.config.key_weights] == [L for L, _ in want] and widths.layer_types == want
    with pytest.raises(KvcxError, match="hybrid model.*without a press"):
        run_calibration(KVConfig.from_scheme("kvcx3"), 3.0, press=parse_press("snapkv:0.5"), **kw)


def test_ruler_prompts_run_over_a_hybrids_refilled_cache(loaded, wikitext_path):
    """--task ruler on a hybrid: each prompt's compressed replies decode over the model's own cache with its
    attention layers' keys and values replaced (sliding windows and linear states kept; MLA's latent and RoPE key,
    two widths), the bits counted over those layers; a random model answers nothing, so the task is dropped, with
    the reason."""
    from kvcx.quality.retrieval import run_retrieval

    _, tok, _ = loaded
    for kind in ("sliding", "linear", "mla"):
        r = run_retrieval({"kvcx": KVConfig.from_scheme()}, ["niah_single"], lengths=[512], depths=[0.5], prompts=2,
                          dataset_file=wikitext_path, loaded=(_hybrid(kind, len(tok)), tok, kind))[0]
        assert [(c.task, c.length) for c in r.cells] == [("niah_single", 512)]
        assert "cannot do it" in r.dropped["niah_single"] and not r.passed
        if kind == "mla":   # the latent's 64 channels at the default's bits, the RoPE key's 32 at 8 (KvcxCache's)
            assert 5.6 < r.bits_per_value < 6.6, r.bits_per_value
        else:
            assert 4.4 < r.bits_per_value < 4.8, r.bits_per_value   # the default's 4.46 and a short context's sinks


def test_a_press_runs_where_it_can_and_is_refused_where_it_cannot(loaded, wikitext_path):
    """Token eviction on the families: KvcxCache presses a sliding hybrid's full-attention layers (generation mode);
    the gate's prefix and retrieval copies evict every layer, so they refuse a hybrid before any window is scored;
    an MLA model's cache holds a latent every head reads (no per-head keys to score and evict): refused in every
    path, KvcxCache's included (before this it ran and counted 0 bits a value)."""
    from kvcx.cache import KvcxCache
    from kvcx.errors import KvcxError
    from kvcx.presses import PressedSetting, parse_press
    from kvcx.quality.retrieval import run_retrieval

    _, tok, _ = loaded
    pressed = PressedSetting(parse_press("snapkv:0.5"), KVConfig.from_scheme())
    kw = dict(dataset_file=wikitext_path, max_windows=1, window=256, stride=128)
    sliding = (_hybrid("sliding", len(tok)), tok, "sliding")
    r = run_validation(pressed, loaded=sliding, mode="generation", **kw)
    assert 0.0 < r.kld < 0.05 and math.isfinite(r.compressed_perplexity)
    for kind, why in (("linear", "hybrid model .0 linear_attention"), ("mla", "layer 0 is multi-head latent")):
        model = _hybrid(kind, len(tok))
        with pytest.raises(KvcxError, match=why):
            run_validation(pressed, loaded=(model, tok, kind), mode="prefix", **kw)
        with pytest.raises(KvcxError, match=why):
            run_retrieval({"snapkv": pressed}, ["niah_single"], lengths=[256], depths=[0.5], prompts=1,
                          dataset_file=wikitext_path, loaded=(model, tok, kind))
    with pytest.raises(KvcxError, match="KvcxCache press 'knorm:0.5': .*layer 0 is multi-head latent"):
        KvcxCache(model.config, scheme="kvcx+knorm:0.5")
    with pytest.raises(KvcxError, match="layer 0 is multi-head latent"):
        run_validation(pressed, loaded=(model, tok, "mla"), mode="generation", **kw)


def test_a_multimodal_class_is_gated_as_its_decoder(loaded, wikitext_path):
    """Gemma 4 (and Gemma 3) checkpoints load through AutoModelForCausalLM as their multimodal class, whose config keeps
    the decoder's attributes in its text_config: every mode and calibrate raised AttributeError on
    ``num_hidden_layers``, and the scores left out the final logit soft cap Gemma4ForConditionalGeneration applies
    from the text config. The scoring's logits are the model's own, and every part of the gate runs on the
    decoder's layers."""
    from kvcx.quality.calibrate import run_calibration
    from kvcx.quality.scoring import forward_hidden, output_logits

    _, tok, _ = loaded
    v = len(tok)
    text = transformers.Gemma4TextConfig(vocab_size=v, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                         num_global_key_value_heads=1, attention_k_eq_v=True,
                                         max_position_embeddings=2048, sliding_window=64, final_logit_softcapping=3.0,
                                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=v,
                                         layer_types=["sliding_attention"] * 3 + ["full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Gemma4Config(text_config=text.to_dict()),
                                                          attn_implementation="sdpa").eval()
    assert type(model).__name__ == "Gemma4ForConditionalGeneration" and not hasattr(model.config, "num_hidden_layers")
    ids = torch.randint(0, v, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        got = output_logits(model, forward_hidden(model, ids)[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert float(got.abs().max()) <= 3.0    # the soft cap's bound
    mm = (model, tok, "tiny Gemma 4, multimodal class")
    kw = dict(dataset_file=wikitext_path, max_windows=1, window=256, stride=128)
    for mode in ("prefix", "generation", "engine"):
        r = run_validation(KVConfig.from_scheme(), loaded=mm, mode=mode, **kw)
        assert r.tokens_scored == 127 and 0.0 < r.kld < 0.01, (mode, r.kld)
    cal = run_calibration(KVConfig.from_scheme("kvcx3"), 3.0, dataset_file=wikitext_path, windows=1, offset=0,
                          window=256, stride=128, loaded=mm)
    assert cal.n_layers == 4 and [t for _, t in cal.layer_types] == ["sliding_attention"] * 3 + ["full_attention"]


def test_calibrate_plans_an_mla_model_and_refuses_query_weights_over_its_latent(loaded, wikitext_path):
    """kvcx calibrate on DeepSeek V3's latent attention: a kvcx3 plan over its layers (the latent with the keys'
    selections; the RoPE key, the cache's values, coded at 8 bits whatever a value selection says) that gates the
    model; query weights (kvcx2w), which weigh key channels the queries read directly, are refused with the layer
    named: the latent is read through kv_b_proj."""
    from kvcx.errors import KvcxError
    from kvcx.quality.calibrate import run_calibration

    _, tok, _ = loaded
    hybrid = (_hybrid("mla", len(tok)), tok, "tiny mla")
    kw = dict(dataset_file=wikitext_path, windows=1, offset=0, window=256, stride=128, loaded=hybrid)
    cal = run_calibration(KVConfig.from_scheme("kvcx3"), 3.0, **kw)
    assert cal.n_layers == 4 and {L for _, L, _ in cal.sensitivity} == {0, 1, 2, 3} and cal.bits_per_value <= 3.0
    r = run_validation(cal.config, dataset_file=wikitext_path, max_windows=1, loaded=hybrid, window=256, stride=128)
    assert r.config["latent_layers"] == [0, 1, 2, 3] and 0.0 < r.kld < 0.01
    with pytest.raises(KvcxError, match="layer 0 is multi-head latent attention"):
        run_calibration(KVConfig.from_scheme("kvcx2w"), 2.6, **kw)


def test_query_weights_read_a_fused_qkv_projections_query_rows():
    """Phi-3 projects queries, keys and values in one qkv_proj: the query weights are its first heads x head_dim
    outputs. A Llama given Phi-3's embeddings, first norm and query rows weighs layer 0's key channels the same."""
    from kvcx.quality.query_weights import window_query_sums

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    phi = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(**common)).eval()
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**common)).eval()
    with torch.no_grad():
        llama.model.embed_tokens.weight.copy_(phi.model.embed_tokens.weight)
        llama.model.layers[0].input_layernorm.weight.copy_(phi.model.layers[0].input_layernorm.weight)
        llama.model.layers[0].self_attn.q_proj.weight.copy_(phi.model.layers[0].self_attn.qkv_proj.weight[:64])
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(1))
    sums = [window_query_sums(m, ids, [0, 64], 128, layers=[0]) for m in (phi, llama)]
    assert sums[0][1] == sums[1][1] == [(4, 2, 16)]
    for (a, n), (b, m) in zip(sums[0][2], sums[1][2]):
        assert n == m == 128 and torch.allclose(a[0], b[0], rtol=1e-5)


def test_queries_are_read_as_the_attention_reads_them():
    """Qwen 3.5's attention splits an output gate off each head of q_proj, normalises the query per head (q_norm, its
    weights not 1 here) and rotates part of it: the query weights of ``calibrate --scheme kvcx2w`` and SnapKV's
    captured queries are those queries, computed here by hand from the module's own parts; the first heads x head_dim
    outputs of q_proj (what a Llama's queries are) are not. The linear-attention layers have no queries."""
    import sys

    from kvcx.quality.eviction import QueryCapture
    from kvcx.quality.query_weights import window_query_sums

    model = _hybrid("linear", 128)
    attn = model.model.layers[3].self_attn
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(-0.9, 2.0, attn.q_norm.weight.numel()))   # Qwen's norm: x (1 + w)
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    seen = {}

    def by_hand(_module, args, kwargs):
        h = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        q, _gate = torch.chunk(attn.q_proj(h).view(*h.shape[:-1], -1, 2 * attn.head_dim), 2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        seen["q"] = rotary(q, q, cos, sin)[0].double()
        seen["raw"] = attn.q_proj(h)[..., :4 * attn.head_dim].double()

    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(1))
    handle = attn.register_forward_pre_hook(by_hand, with_kwargs=True)
    try:
        layers, shapes, parts = window_query_sums(model, ids, [0], 160, layers=[3])
    finally:
        handle.remove()
    assert layers == [3] and shapes == [(4, 2, 64)] and parts[0][1] == 160
    want = seen["q"].reshape(2, 2, 160, 64).pow(2).sum(dim=(1, 2))
    torch.testing.assert_close(parts[0][0][0], want, rtol=1e-6, atol=1e-9)
    raw = seen["raw"].reshape(160, 2, 2, 64).pow(2).sum(dim=(0, 2))
    assert not torch.allclose(raw, want, rtol=0.1)
    with torch.no_grad(), QueryCapture(model, 32) as capture:
        model(input_ids=ids[None, :160])
    got = capture.numpy()
    assert [q is None for q in got] == [True, True, True, False]
    assert model.config._attn_implementation == "sdpa"   # the tap's block restored it
    torch.testing.assert_close(torch.from_numpy(got[3]).double(), seen["q"][0, :, -32:], rtol=1e-5, atol=1e-6)
