"""MLA (DeepSeek V3) in KvcxCache: a decode step attends over the decoded latent with the model's kv_b_proj absorbed
(kvcx.cache.latent), and the model expands the step's own token alone, never the context.

What is asserted:
- the absorbed attention equals transformers' own (the latent expanded by the module's expand_kv, then attention)
  within FP32 rounding, for one token and for draft tokens, unpadded and left-padded; in BF16 its error against the
  FP32 attention is no larger than the BF16 reference's;
- in a model: every decode step of every MLA layer attends over the latent (the layers' "absorbed" counts), the
  module's expand_kv sees one token a decode step, 8-bit codes give DynamicCache's greedy tokens, and the logits
  equal those of the materialising path (fused=False: decoded, then expanded) within FP32 rounding;
- a module the absorption does not fit (a kv_b_proj that is not a plain linear layer: a quantized checkpoint's)
  gets the module's own expansion of the decoded latent, with the same tokens; states of another form (an older
  transformers that hands the cache expanded keys and values) are materialised as before;
- on the Triton backend (a CUDA model's) the latent is kept and decoded on the device, its steps the CPU store's.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from bench.families import build, decode, decoded_caches, family_configs, prompts  # noqa: E402
from kvcx.cache import KvcxCache  # noqa: E402
from kvcx.cache.attention_fn import eager_attention  # noqa: E402
from kvcx.cache.latent import absorbed_attention, unabsorbable  # noqa: E402

MLA = "DeepSeek V3 (MLA)"
PROMPT, STEPS = 256, 8


def _model(dtype=None):
    cfg = family_configs(64, PROMPT)[MLA]()
    cfg.eos_token_id = None
    return build(cfg, dtype=dtype)


def _states(attn, B, Q, T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    rank = attn.kv_b_proj.weight.shape[1]
    q = torch.randn(B, H, Q, nope + rope, generator=g)
    c = torch.randn(B, 1, T, rank, generator=g)
    r = torch.randn(B, 1, T, rope, generator=g)
    return q.to(dtype), c.to(dtype), r.to(dtype)


def _expanded(attn, q, c, r, mask):
    """transformers' own: the latent expanded by the module, then attention (FP32 softmax)."""
    k, v = attn.expand_kv(c, r)
    return eager_attention(attn, q, k, v, mask, scaling=attn.scaling)[0]


@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_the_absorbed_attention_is_the_expanded_attention(Q, padded):
    attn = _model().model.layers[0].self_attn
    B, T = 2, 200
    q, c, r = _states(attn, B, Q, T, torch.float32)
    mask = None
    if padded or Q > 1:   # row 1 left-padded by 5 tokens; the step's own tokens causal among them
        i, j = torch.arange(Q)[:, None], torch.arange(T)[None, :]
        mask = (j <= T - Q + i)[None, None].expand(B, 1, Q, T).clone()
        if padded:
            mask[1, :, :, :5] = False
    assert unabsorbable(attn, q, c, r) is None
    with torch.no_grad():
        got = absorbed_attention(attn, q, c, r, mask, attn.scaling)
        want = _expanded(attn, q, c, r, mask)
    assert got.shape == want.shape == (B, Q, attn.num_heads, attn.v_head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_in_bf16_the_absorbed_attention_rounds_no_worse_than_the_reference():
    model = _model()
    attn32 = model.model.layers[0].self_attn
    q, c, r = _states(attn32, 1, 1, 300, torch.float32, seed=3)
    with torch.no_grad():
        exact = _expanded(attn32, q, c, r, None)
        attn16 = model.to(torch.bfloat16).model.layers[0].self_attn
        q16, c16, r16 = q.bfloat16(), c.bfloat16(), r.bfloat16()
        ours = absorbed_attention(attn16, q16, c16, r16, None, attn16.scaling)
        ref = _expanded(attn16, q16, c16, r16, None)
    assert ours.dtype == torch.bfloat16
    err_ours = float((ours.float() - exact).abs().max())
    err_ref = float((ref.float() - exact).abs().max())
    assert err_ours <= err_ref, (err_ours, err_ref)


def _counting_expansions(model, monkeypatch):
    """The tokens each call of the MLA modules' expand_kv expanded."""
    seen = []
    for layer in model.model.layers:
        attn = layer.self_attn
        real = attn.expand_kv

        def counted(c, r, real=real):
            seen.append(c.shape[-2])
            return real(c, r)

        monkeypatch.setattr(attn, "expand_kv", counted)
    return seen


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_steps_attend_over_the_latent_and_expand_one_token(batch, monkeypatch):
    model = _model()
    ids, mask = prompts(batch, PROMPT)
    model.set_attn_implementation("eager")
    ref_tokens, _ = decode(model, DynamicCache(config=model.config), ids, mask, STEPS)
    model.set_attn_implementation("kvcx")
    seen = _counting_expansions(model, monkeypatch)
    cache = KvcxCache(model.config, bits=8)
    tokens, logits = decode(model, cache, ids, mask, STEPS)
    layers = len(model.model.layers)
    assert seen == [PROMPT] * layers + [1] * (STEPS - 1) * layers   # the prompt once; then each step's own token
    report = cache.memory_report()
    assert all(r["steps"]["absorbed"] == STEPS - 1 for r in report["layers"]), report["layers"]
    assert "absorbed" in report["layers"][0]["fused_unsupported"]
    assert torch.equal(tokens, ref_tokens)

    # the materialising path (decoded, then expanded by the model): the same logits within FP32 rounding
    seen.clear()
    cache = KvcxCache(model.config, bits=8, fused=False)
    _, logits_mat = decode(model, cache, ids, mask, STEPS, forced=tokens)
    assert seen[layers:] == [PROMPT + i + 1 for i in range(STEPS - 1) for _ in range(layers)]
    assert all(r["steps"]["absorbed"] == 0 for r in cache.memory_report()["layers"])
    torch.testing.assert_close(logits, logits_mat, rtol=1e-4, atol=1e-4)


def test_a_kv_b_proj_the_absorption_does_not_fit_is_expanded_by_the_model(monkeypatch):
    model = _model()
    ids, mask = prompts(1, PROMPT)
    model.set_attn_implementation("kvcx")
    _, want = decode(model, KvcxCache(model.config), ids, mask, STEPS)

    class QuantizedLinear(torch.nn.Linear):   # a checkpoint's own linear class: its weight may not be what it applies
        pass

    for layer in model.model.layers:
        old = layer.self_attn.kv_b_proj
        new = QuantizedLinear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        layer.self_attn.kv_b_proj = new
    attn = model.model.layers[0].self_attn
    q, c, r = _states(attn, 1, 1, 10, torch.float32)
    assert "QuantizedLinear" in unabsorbable(attn, q, c, r)
    seen = _counting_expansions(model, monkeypatch)
    cache = KvcxCache(model.config)
    _, got = decode(model, cache, ids, mask, STEPS)
    assert seen[-1] == PROMPT + STEPS - 1   # the whole context, decoded and expanded
    assert all(r["steps"]["absorbed"] == 0 and r["steps"]["materialised"] == STEPS - 1
               for r in cache.memory_report()["layers"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_states_of_another_form_are_materialised_as_before():
    """An older transformers hands an MLA layer expanded keys (nope + rope a head) and values, one per query head:
    not the latent the absorption reads, so the layer materialises them (and says why)."""
    cfg = family_configs(64, PROMPT)[MLA]()
    cfg._attn_implementation = "kvcx"   # the fused steps' attention: what the absorbed steps need too
    cache = KvcxCache(cfg)
    H = cfg.num_attention_heads
    k = torch.randn(1, H, 128, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    v = torch.randn(1, H, 128, cfg.v_head_dim)
    cache.update(k, v, 0)
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert keys.shape[-2] == 129 and values.shape[-2] == 129   # the context, materialised
    layer = cache.memory_report()["layers"][0]
    assert layer["steps"]["materialised"] == 1 and layer["steps"]["absorbed"] == 0
    assert "absorbed" not in layer["fused_unsupported"]


def test_a_module_that_is_not_mla_attention_is_named():
    model = build(family_configs(64, PROMPT)["Llama"]())
    attn = model.model.layers[0].self_attn
    x = torch.zeros(1, 1, 4, 8)
    assert "no kv_b_proj" in unabsorbable(attn, x, x, x)


def test_draft_tokens_over_a_packed_latent_attend_causally():
    """A step of 3 tokens after the prompt (speculative decoding's drafts): absorbed, each draft token sees the
    context and the drafts before it, as DynamicCache's step does."""
    model = _model()
    ids = prompts(1, PROMPT)[0]
    drafts = torch.tensor([[5, 17, 42]])
    outs = []
    for attn, cache in (("eager", DynamicCache(config=model.config)), ("kvcx", KvcxCache(model.config, bits=8))):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            outs.append(model(input_ids=drafts, past_key_values=cache, use_cache=True).logits)
    assert all(r["steps"]["absorbed"] == 1 for r in cache.memory_report()["layers"])
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=2e-3 * float(outs[0].abs().max()))


def test_a_step_of_several_tokens_without_a_mask_is_causal_among_them():
    """The "kvcx" attention handed no mask for a latent step of several tokens (a model that leaves causality to the
    attention function): the step's own tokens causal among them, every earlier one visible."""
    from kvcx.cache.attention_fn import latent_attention, tail_mask

    attn = _model().model.layers[0].self_attn
    q, c, r = _states(attn, 1, 4, 150, torch.float32)

    class Held:   # what a KvcxLayer posts for a latent step (attention_fn.LatentStep)
        absorbed = None

        def latent_states(self, attention_mask):
            return c, r, attention_mask

        def after_latent(self, absorbed):
            self.absorbed = absorbed

    held = Held()
    with torch.no_grad():
        got, _ = latent_attention(attn, held, q, None, scaling=attn.scaling)
        want = _expanded(attn, q, c, r, tail_mask(4, 150, q.device))
    assert held.absorbed is True
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_a_latent_step_no_attention_took_is_not_found_by_the_next_steps_attention():
    """An MLA layer's latent step whose attention never ran (the forward stopped) is dropped when the layer's next
    step takes another path (a prompt chunk, materialised): the module of that index gets the reference attention
    over what the layer returned, not the old step."""
    from kvcx.cache.attention_fn import HANDOFF

    model = _model()
    model.set_attn_implementation("kvcx")
    cache = KvcxCache(model.config)
    ids = prompts(1, PROMPT)[0]
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        attn = model.model.layers[0].self_attn
        c = torch.randn(1, 1, 1, cache.layers[0].keys.shape[-1])
        r = torch.randn(1, 1, 1, cache.layers[0].values.shape[-1])
        cache.update(c, r, 0)                  # a decode step posted; its attention never runs
        assert HANDOFF.take_latent(attn) is cache.layers[0]
        cache.update(c, r, 0)                  # posted again, then the next step is a chunk of 64 tokens
        cache.update(c.expand(1, 1, 64, -1).contiguous(), r.expand(1, 1, 64, -1).contiguous(), 0)
        assert HANDOFF.take_latent(attn) is None


@pytest.mark.slow   # Triton's interpreter
def test_on_the_triton_backend_the_latent_is_kept_and_decoded_on_the_device():
    """backend="triton" (a CUDA model's store; Triton's interpreter on a CPU): the latent and the RoPE key, of two
    widths, are kept where the model runs and decoded there by the Triton codecs (bit for bit the CPU kernels'), so
    the steps equal the CPU store's; nothing is held on the host."""
    model = _model()
    ids, mask = prompts(1, 128)
    model.set_attn_implementation("kvcx")
    got = {}
    for backend in ("cpu", "triton"):
        cache = KvcxCache(model.config, backend=backend)
        got[backend] = decode(model, cache, ids, mask, 3)[1]
        report = cache.memory_report()
        assert report["backend"] == backend
        assert all(r["steps"]["absorbed"] == 2 for r in report["layers"])
    torch.testing.assert_close(got["triton"], got["cpu"], rtol=1e-5, atol=1e-5)


def test_a_latent_module_with_nothing_to_expand_with_is_a_clear_error(monkeypatch):
    """An MLA attention module that neither fits the absorption nor has transformers' expand_kv (a model's own code):
    one KvcxError naming the layer and the fix (KvcxCache's layer: fused=False; StaticKvcxCache's: KvcxCache with
    fused=False instead), not an AttributeError."""
    from kvcx.cache.attention_fn import latent_attention
    from kvcx.cache.layers import KvcxLayer
    from kvcx.cache.static_latent import StaticKvcxLatentLayer
    from kvcx.errors import KvcxError

    attn = _model().model.layers[0].self_attn
    q, c, r = _states(attn, 1, 1, 20, torch.float32)

    class Held:
        unexpandable_fix = KvcxLayer.unexpandable_fix

        def latent_states(self, attention_mask):
            return c, r, attention_mask

        def after_latent(self, absorbed):
            raise AssertionError("no attention ran")

    class OwnAttention(torch.nn.Module):   # its own MLA code: a latent of the same widths, no expand_kv
        layer_idx, num_heads = 0, attn.num_heads

    with pytest.raises(KvcxError, match=r"layer 0: .*OwnAttention.*no expand_kv.*fused=False"):
        latent_attention(OwnAttention(), Held(), q, None, scaling=1.0)
    Held.unexpandable_fix = StaticKvcxLatentLayer.unexpandable_fix   # a static cache's layer: KvcxCache instead
    with pytest.raises(KvcxError, match=r"layer 0: .*no expand_kv.*KvcxCache\(model.config, fused=False\) .*instead "
                                        r"of StaticKvcxCache"):
        latent_attention(OwnAttention(), Held(), q, None, scaling=1.0)


def test_the_packed_latent_holds_the_bytes_of_its_codecs_and_one_layer_of_scratch():
    """In BF16 (DynamicCache's bytes its FP16-equivalent ones), a 2,048-token prompt and 4 decode steps: the packed
    latent (64 channels, 4-bit codes and their per-channel ranges: 4.5 bits a value) and RoPE key (32 channels, 8 bits
    a value and two bytes of range a channel and 64 tokens: 8.25) with the residual hold at most 0.38x what
    DynamicCache(config=...) holds for them (their mean, 5.75 bits, is 0.36x of 16; DeepSeek V3's 512 + 64: 4.92
    bits, 0.31x); the scratch the absorbed steps decode into is one layer's latent and RoPE key (shared by the layers,
    grown by half at most), so its share falls with the layer count (2 of 61 in DeepSeek V3's)."""
    from kvcx.cache.kvcx_cache import dynamic_cache_bytes

    cfg = family_configs(64, 2048)[MLA]()
    cfg.eos_token_id = None
    model = build(cfg, dtype=torch.bfloat16)
    ids, mask = prompts(1, 2048)
    dynamic, cache = decoded_caches(model, ids, mask, 4)
    report = cache.memory_report()
    assert all(r["steps"]["absorbed"] == 3 for r in report["layers"])
    dyn = dynamic_cache_bytes(dynamic)
    assert report["packed_bytes"] + report["residual_bytes"] <= 0.38 * dyn, (report, dyn)
    assert all(r["codecs"] == {"latent": "4-bit asym g64 per-channel +1 sink",
                               "rope_key": "8-bit mean, a width per channel, g64 per-channel +1 sink"}
               for r in report["layers"])
    one_layer = dyn // len(cache.layers)
    assert one_layer <= report["scratch_bytes"] <= 1.5 * one_layer + 4096, (report["scratch_bytes"], one_layer)


@pytest.mark.parametrize("scheme, group, bits", [("kvcx", 64, 8.0), ("kvcx2w", 32, 8.0), ("kvcx2v", 64, 8.0),
                                                 ("kvcx4w", 64, 8.0), ("symmetric", 128, 8.0)])
def test_the_rope_key_gets_the_guards_key_codec_at_8_bits(scheme, group, bits):
    """An MLA layer's shared RoPE key (the values transformers hands its cache) is a key: kvcx's own schemes give it a
    width per channel at 8 bits, in groups of the keys' tokens (of the residual where keys are grouped per token),
    the values' sinks; the cache's residual is a multiple of that group."""
    from kvcx.cache.layer_config import latent_rope_codec
    from kvcx.codecs import KVConfig, WidthCodec

    kv = KVConfig.from_scheme(scheme)
    rope = latent_rope_codec(kv, 128)
    assert isinstance(rope, WidthCodec) and rope.bits == bits and rope.group_size == group
    assert rope.sinks == kv.value.sinks
    cfg = family_configs(64, 512)[MLA]()
    cache = KvcxCache(cfg, scheme=scheme, residual_length=128) if scheme == "symmetric" else KvcxCache(cfg, scheme=scheme)
    assert cache.residual_length % rope.group_size == 0


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "q4_0", "turboquant_k8v4"])
def test_an_engines_format_and_8_bit_values_leave_the_rope_key_as_they_code_it(scheme):
    """An engine's format is emulated as the engine writes it (the RoPE key with the values' codec), and values of 8
    bits already are the RoPE key's."""
    from kvcx.cache.layer_config import latent_rope_codec
    from kvcx.codecs import KVConfig

    kv = KVConfig.from_scheme(scheme)
    assert latent_rope_codec(kv, 64) is kv.value
    eight = KVConfig.from_scheme("kvcx", bits=8)
    assert latent_rope_codec(eight, 64) is eight.value


def test_the_rope_key_on_the_device_store_decodes_as_on_the_cpu():
    """backend="triton" (the interpreter in CI): the MLA layers keep the latent and the 8-bit RoPE key on the device
    (DeviceChunkKV, the Triton codecs) and the tokens and logits of 4 greedy steps equal the CPU store's."""
    from kvcx.cache.device_store import DeviceChunkKV

    cfg = family_configs(64, 256)[MLA]()
    cfg.eos_token_id = None
    model = build(cfg, attn="kvcx")
    ids, mask = prompts(1, 200)
    runs = {}
    for backend in ("cpu", "triton"):
        cache = KvcxCache(model.config, backend=backend)
        runs[backend] = decode(model, cache, ids, mask, 4)
        rope = [r["codecs"]["rope_key"] for r in cache.memory_report()["layers"]]
        assert rope == ["8-bit mean, a width per channel, g64 per-channel +1 sink"] * len(cache.layers)
    assert all(isinstance(layer.store, DeviceChunkKV) for layer in cache.layers)
    assert torch.equal(runs["cpu"][0], runs["triton"][0])
    torch.testing.assert_close(runs["cpu"][1], runs["triton"][1], rtol=0, atol=1e-5)


def test_a_config_naming_the_mla_layers_codes_them_as_the_cache_does():
    """The gate names a model's MLA layers in its setting (KVConfig.latent_layers) and hands that setting to
    KvcxCache in generation mode: the cache's codecs are then the ones it chooses alone, and StaticKvcxCache keeps
    its 4-bit RoPE key; a config naming other layers than the model's MLA layers is a KvcxError saying which."""
    import re

    from kvcx.cache import StaticKvcxCache
    from kvcx.codecs import KVConfig
    from kvcx.errors import KvcxError

    cfg = family_configs(64, PROMPT)[MLA]()
    layers = list(range(cfg.num_hidden_layers))
    alone = KvcxCache(cfg)
    named = KvcxCache(cfg, kv_config=KVConfig.from_scheme().with_latent_layers(layers))
    assert [L.codecs_described() for L in named.layers] == [L.codecs_described() for L in alone.layers]
    assert named.layers[0].codecs_described()["rope_key"].startswith("8-bit")
    static = StaticKvcxCache(cfg, max_cache_len=512, kv_config=KVConfig.from_scheme().with_latent_layers(layers))
    assert static.kv_config.latent_layers == ()
    for wrong, theirs in ((layers[:1], layers), (layers, [])):
        model_cfg = cfg if theirs else family_configs(64, PROMPT)["Llama"]()
        with pytest.raises(KvcxError, match=re.escape(f"this model's MLA layers are {theirs or 'none'}")):
            KvcxCache(model_cfg, kv_config=KVConfig.from_scheme().with_latent_layers(wrong))
