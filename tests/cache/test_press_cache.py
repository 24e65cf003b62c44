"""Token eviction inside KvcxCache (pruning at prefill) on the real embedded model: generate() after a press
equals the prefix path (the exact prefill evicted by the same press, then the same greedy decode at the context's
positions), the cache keeps counting the context, and what it cannot do is a clear error."""
import pytest

from kvcx.errors import KvcxError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def prompt(loaded, wikitext_path):
    _, tok, _ = loaded
    text = wikitext_path.read_text(encoding="utf-8")[5000:20000]
    return torch.tensor(tok(text)["input_ids"][:700])[None]


def _reference(model, ids, press, new_tokens):
    """The prefix path: the exact prefill, evicted by ``press`` (kvcx.quality.eviction), then greedy decoding over a
    DynamicCache of the kept tokens at the context's own positions."""
    from kvcx.quality.bridge import cache_to_tensors, make_dynamic_cache, tensors_to_layers
    from kvcx.quality.eviction import QueryCapture, evict
    from kvcx.quality.scoring import greedy_reply
    from kvcx.quality.scoring import forward_hidden, output_logits

    with torch.inference_mode():
        with QueryCapture(model, press.window) as capture:
            hidden, cache = forward_hidden(model, ids)
        kept, _ = evict(cache_to_tensors(cache), press, capture.numpy())
        first = int(output_logits(model, hidden[-1:]).argmax(-1))
        rest = greedy_reply(model, torch.tensor([[first]]), make_dynamic_cache(tensors_to_layers(kept, "cpu")),
                            new_tokens - 1, ids.shape[1])
    return [first] + rest, kept


@pytest.mark.parametrize("spec", ["snapkv:0.25", "knorm:0.5", "streaming:0.5"])
def test_generate_after_a_press_equals_the_prefix_path(kvcx_attention, loaded, prompt, spec):
    from kvcx.cache import KvcxCache
    from kvcx.presses import parse_press

    model = kvcx_attention
    press = parse_press(spec)
    want, kept = _reference(model, prompt, press, 8)
    cache = KvcxCache(model.config, scheme=f"q8_0+{spec}", residual_length=64)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                         max_new_tokens=8, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == want
    n = prompt.shape[1]
    held = press.kept_count(n)
    assert kept["layer_0_key"].shape[2] == held
    # the cache stands for the whole context (positions go on) and holds the kept tokens and the new ones
    assert cache.get_seq_length() == n + 7
    assert all(layer.cumulative_length == held + 7 for layer in cache.layers)
    report = cache.memory_report()
    # q8_0 is read by the materialising path: each step attends through the layer's own mask
    assert report["tokens"] == n + 7 and report["attention_steps"]["materialised"] > 0
    # bytes against the whole context (evicted tokens included): eviction shows in the bits per value
    cfg = model.config
    assert report["fp16_equivalent_bytes"] == 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * \
        cfg.head_dim * (n + 7)
    assert report["bits_per_value"] < 0.75 * 8.5    # q8_0 is 8.5 bits a value; the FP32 residual counts too


def test_a_multi_token_step_after_the_press_is_causal(kvcx_attention, loaded, prompt):
    """The question after a pruned prompt, several tokens in one step (the materialising path and its own mask),
    gives the hidden states the prefix path gives."""
    from kvcx.cache import KvcxCache
    from kvcx.presses import parse_press
    from kvcx.quality.bridge import cache_to_tensors, make_dynamic_cache, tensors_to_layers
    from kvcx.quality.eviction import evict
    from kvcx.quality.scoring import forward_hidden

    model = kvcx_attention
    press = parse_press("knorm:0.5")
    ctx, question = prompt[:, :600], prompt[:, 600:700]
    with torch.inference_mode():
        _, exact = forward_hidden(model, ctx)
        kept, _ = evict(cache_to_tensors(exact), press, None)
        want = forward_hidden(model, question, make_dynamic_cache(tensors_to_layers(kept, "cpu")), start=600)[0]
        for fused in (None, False):
            cache = KvcxCache(model.config, scheme="q8_0+knorm:0.5", residual_length=64, fused=fused)
            forward_hidden(model, ctx, cache, chunk=600)
            got = forward_hidden(model, question, cache, chunk=100)[0]
            err = (got - want).abs().max() / want.abs().max()
            assert err < 0.02, (fused, float(err))


def test_press_errors(loaded, kvcx_attention, prompt):
    from kvcx.cache import KvcxCache

    model = kvcx_attention
    with pytest.raises(KvcxError, match=r"compose it with a codec, e.g. scheme='kvcx\+snapkv:0.5'"):
        KvcxCache(model.config, scheme="snapkv:0.5")
    with pytest.raises(KvcxError, match=r"keep ratio must be in \(0, 1\]"):
        KvcxCache(model.config, scheme="kvcx+knorm:1.5")
    two = torch.cat([prompt[:, :100], prompt[:, 100:200]])
    with pytest.raises(KvcxError, match="use one KvcxCache per sequence"):
        model(input_ids=two, past_key_values=KvcxCache(model.config, scheme="kvcx+knorm:0.5"))
    model.set_attn_implementation("sdpa")
    with pytest.raises(KvcxError, match=r"needs the model's attention to be 'kvcx'"):
        model(input_ids=prompt[:, :100], past_key_values=KvcxCache(model.config, scheme="kvcx+knorm:0.5"))


def test_reset_presses_again(kvcx_attention, prompt):
    from kvcx.cache import KvcxCache

    model = kvcx_attention
    cache = KvcxCache(model.config, scheme="kvcx+streaming:0.5", residual_length=64)
    with torch.inference_mode():
        model(input_ids=prompt[:, :400], past_key_values=cache)
        assert cache.layers[3].cumulative_length == 200 and cache.get_seq_length() == 400
        cache.reset()
        model(input_ids=prompt[:, :300], past_key_values=cache)
    assert cache.layers[3].cumulative_length == 150 and cache.get_seq_length() == 300


def test_an_evicted_cache_gives_each_layer_its_own_causal_mask(loaded, prompt):
    """A context whose layers keep different counts (a plan's keep ratio per layer) runs through the "kvcx"
    attention with each layer's own mask: with even layers it equals a DynamicCache exactly; with uneven ones each
    layer holds what its ratio keeps and the scores stay finite."""
    from kvcx.presses import Press
    from kvcx.quality.bridge import cache_to_tensors, make_dynamic_cache, tensors_to_layers
    from kvcx.quality.eviction import attending, evict
    from kvcx.quality.scoring import forward_hidden

    model = loaded[0]
    n_layers = model.config.num_hidden_layers
    ctx, cont = prompt[:, :500], prompt[:, 500:600]
    with torch.inference_mode():
        _, exact = forward_hidden(model, ctx)
        tensors = cache_to_tensors(exact)
        even, _ = evict(tensors, Press("knorm", 0.5), None)
        want = forward_hidden(model, cont, make_dynamic_cache(tensors_to_layers(even, "cpu")), start=500)[0]
        from kvcx.cache.pressing import EvictedCache

        forced = EvictedCache()
        for i, (k, v) in enumerate(tensors_to_layers(even, "cpu")):
            forced.update(k, v, i)
        with attending(model, forced):
            got = forward_hidden(model, cont, forced, start=500)[0]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        keeps = tuple(1.0 if i % 3 == 0 else 0.25 for i in range(n_layers))
        uneven, _ = evict(tensors, Press("knorm", 0.5, layer_keep=keeps), None)
        cache = make_dynamic_cache(tensors_to_layers(uneven, "cpu"))
        assert isinstance(cache, EvictedCache)
        with attending(model, cache):
            hidden = forward_hidden(model, cont, cache, start=500)[0]
        assert model.config._attn_implementation != "kvcx" and torch.isfinite(hidden).all()
        assert [cache.layers[i].keys.shape[-2] for i in range(3)] == [600, 225, 225]


def test_a_plan_with_a_keep_ratio_per_layer_generates_as_the_prefix_path(kvcx_attention, prompt):
    """KvcxCache(kv_config=a plan with keep ratios per layer, as load_plan returns it): each layer holds its own
    count and decodes with its own mask, as the prefix path over an EvictedCache does."""
    from kvcx.cache import KvcxCache
    from kvcx.codecs import KVConfig
    from kvcx.presses import Press, PressedSetting
    from kvcx.quality.bridge import cache_to_tensors, make_dynamic_cache, tensors_to_layers
    from kvcx.quality.eviction import attending, evict
    from kvcx.quality.scoring import greedy_reply
    from kvcx.quality.scoring import forward_hidden, output_logits

    model = kvcx_attention
    n_layers = model.config.num_hidden_layers
    press = Press("knorm", 0.5, layer_keep=tuple(1.0 if i < 4 else 0.25 for i in range(n_layers)))
    ids = prompt[:, :600]
    with torch.inference_mode():
        hidden, exact = forward_hidden(model, ids)
        kept, _ = evict(cache_to_tensors(exact), press, None)
        ref_cache = make_dynamic_cache(tensors_to_layers(kept, "cpu"))
        first = int(output_logits(model, hidden[-1:]).argmax(-1))
        with attending(model, ref_cache):
            want = [first] + greedy_reply(model, torch.tensor([[first]]), ref_cache, 5, 600)
    cache = KvcxCache(model.config, kv_config=PressedSetting(press, KVConfig.from_scheme("q8_0")), residual_length=64)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=6,
                         do_sample=False)
    assert out[0, 600:].tolist() == want
    assert [cache.layers[i].cumulative_length for i in (0, 4)] == [605, 155]
