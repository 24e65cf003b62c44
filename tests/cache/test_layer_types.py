"""KvcxCache reads a model's config the way transformers' DynamicCache does (kvcx.cache.layer_types): one layer per
cache layer, of the kind its layer type says, with its window, heads and widths; configs that contradict themselves
and layer types kvcx cannot pack are clear errors at construction (or at the first step), never a wrong answer."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer  # noqa: E402

from bench.families import family_configs, unsupported_config  # noqa: E402
from kvcx.cache import KvcxCache  # noqa: E402
from kvcx.cache.kept import layer_kwargs  # noqa: E402
from kvcx.cache.layer_types import CHUNKED, FULL, SLIDING, STATE, UNSUPPORTED, layer_specs  # noqa: E402
from kvcx.cache.layers import KvcxLayer  # noqa: E402
from kvcx.cache.window_layer import KvcxWindowLayer  # noqa: E402
from kvcx.errors import KvcxError  # noqa: E402

FAMILIES = family_configs(window=64, prompt=512)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_layers_are_the_ones_dynamic_cache_builds(name):
    """Every family: as many layers as DynamicCache(config=...) builds, sliding where it slides (with its window),
    transformers' own class where it keeps a recurrent state, full elsewhere; the heads and widths the config says."""
    cfg = FAMILIES[name]()
    specs = layer_specs(cfg)
    dynamic = DynamicCache(config=cfg).layers
    cache = KvcxCache(cfg)
    assert len(specs) == len(dynamic) == len(cache.layers)
    for spec, theirs, ours in zip(specs, dynamic, cache.layers):
        if isinstance(theirs, DynamicSlidingWindowLayer):
            assert spec.kind in (SLIDING, CHUNKED) and spec.window == theirs.sliding_window
            assert isinstance(ours, KvcxWindowLayer) and ours.get_max_length() == spec.window
        elif isinstance(theirs, LinearAttentionLayer):
            assert spec.kind == STATE and type(ours) is LinearAttentionLayer
        else:
            assert spec.kind == FULL and type(ours) is KvcxLayer
    attention = [s for s in specs if s.packed and not s.latent]
    assert all(s.kv_heads and s.key_dim and s.query_group for s in attention)


def test_per_layer_heads_and_widths_and_kv_sharing_gemma4():
    """Gemma 4: its global layers have their own head dim and KV heads (per_layer_config); with KV sharing the last
    layers have no cache layer, and the last cache layer of each type is the one whose states they read."""
    cfg = transformers.Gemma4TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=64, global_head_dim=128, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, num_kv_shared_layers=3,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])
    specs = layer_specs(cfg)
    packed = [s for s in specs if s.packed]
    assert [(s.kind, s.kv_heads, s.key_dim, s.query_group) for s in packed] == [
        (SLIDING, 2, 64, 2), (SLIDING, 2, 64, 2), (FULL, 1, 128, 4)]
    assert [s.shared for s in packed] == [False, True, True]
    # transformers 5.19 builds no cache layer for the KV-shared layers, 5.2x a placeholder for each: as it builds
    dynamic = DynamicCache(config=cfg).layers
    assert len(specs) == len(dynamic) and all(s.kind == STATE for s in specs[3:])
    assert [type(layer).__name__ for layer in KvcxCache(cfg).layers][3:] == [type(x).__name__ for x in dynamic[3:]]


def test_mla_packs_the_latent_and_says_why_it_materialises():
    cfg = FAMILIES["DeepSeek V3 (MLA)"]()
    specs = layer_specs(cfg)
    assert all(s.kind == FULL and s.latent and s.kv_heads is None for s in specs)
    assert "MLA latent" in specs[0].describe()


def test_a_layer_type_kvcx_cannot_pack_is_an_error_naming_it_or_kept():
    cfg = unsupported_config()
    with pytest.raises(KvcxError, match=r"layers 1 \(compressed_sparse_attention\), 3 \(heavily_compressed_attention\) "
                                        r"are layer types kvcx cannot pack.*unsupported='keep'"):
        KvcxCache(cfg)
    cache = KvcxCache(cfg, unsupported="keep")
    kinds = [s.kind for s in cache.specs]
    assert kinds == [SLIDING, UNSUPPORTED, SLIDING, UNSUPPORTED]
    kept = [type(layer).__name__ for layer in cache.layers]
    assert kept[0] == kept[2] == "KvcxWindowLayer" and kept[1] != "KvcxLayer" and kept[3] != "KvcxLayer"
    report = cache.memory_report()["layers"]
    assert [r["kvcx"] for r in report] == ["packed", "kept", "packed", "kept"]
    assert "unsupported='keep'" in report[1]["kept_because"]
    with pytest.raises(KvcxError, match="unsupported='maybe'.*'error'.*'keep'"):
        KvcxCache(cfg, unsupported="maybe")


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    return transformers.Gemma3TextConfig(**{**base, **kw})


def test_configs_that_contradict_themselves_name_the_layer_and_the_fix():
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"])
    cfg.layer_types = ["sliding_attention"] * 3
    with pytest.raises(KvcxError, match="lists 3 layer_types for num_hidden_layers=2; one per layer"):
        KvcxCache(cfg)
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cfg.sliding_window = 0
    with pytest.raises(KvcxError, match=r"layer 0 \(sliding_attention\): sliding_window must be a positive number "
                                        "of tokens, got 0"):
        KvcxCache(cfg)
    cfg.sliding_window = None
    with pytest.raises(KvcxError, match=r"layer 0 \(sliding_attention\): the config gives this layer no "
                                        "sliding_window"):
        KvcxCache(cfg)
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"])
    cfg.layer_types = ["sliding_attention", "fancy_attention"]
    with pytest.raises(KvcxError, match=r"layer 1 \(fancy_attention\) is a layer type kvcx cannot pack"):
        KvcxCache(cfg)
    with pytest.raises(KvcxError, match="neither kvcx nor this transformers knows the layer type 'fancy_attention'"):
        KvcxCache(cfg, unsupported="keep")
    plain = SimpleNamespace(num_hidden_layers=2, layer_types=["full_attention", 3], num_attention_heads=4,
                            hidden_size=64)   # a config transformers' own classes would not even build
    with pytest.raises(KvcxError, match="layer 1: the config's layer type 3 is not a name"):
        KvcxCache(plain)
    with pytest.raises(KvcxError, match="num_hidden_layers=0; KvcxCache needs a positive layer count"):
        KvcxCache(SimpleNamespace(num_hidden_layers=0))


def test_states_that_do_not_match_the_config_name_the_layer_at_the_first_step():
    """Per-layer dims that do not match the tensors the model hands the cache: a KvcxError at the first step."""
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cache = KvcxCache(cfg)
    k = torch.zeros(1, 3, 4, 16)
    with pytest.raises(KvcxError, match=r"layer 0 \(sliding_attention of 8 tokens\): the model hands this layer 3 KV "
                                        "heads of keys 16 and values 16 wide, its config says 2 of 16 and 16"):
        cache.update(k, k, 0)
    k = torch.zeros(1, 2, 4, 32)
    with pytest.raises(KvcxError, match="the model hands this layer 2 KV heads of keys 32"):
        cache.update(k, k, 1)
    # a linear-attention layer's index handed keys and values
    qcfg = FAMILIES["Qwen 3.5 (linear)"]()
    with pytest.raises(KvcxError, match="says this layer has no per-token keys and values"):
        KvcxCache(qcfg).update(torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 4, 64), 0)


def test_a_window_the_model_names_must_be_the_configs():
    """The model's attention passes its sliding window; a cache built from another config is refused by name."""
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cache = KvcxCache(cfg)
    layer = cache.layers[0]
    with pytest.raises(KvcxError, match=r"attends over a window of 16 tokens: build the cache from the model's own "
                                        "config"):
        layer._check_window(16)
    with pytest.raises(KvcxError, match="over a sliding window of 8 tokens, its config's layer_types say full"):
        cache.layers[1]._check_window(8)


def test_the_layers_an_engine_keeps_exact_are_transformers_own():
    """vLLM's TurboQuant leaves a dense model's first and last two layers in the model's dtype: KvcxCache with that
    scheme holds them in transformers' DynamicLayer, packs the others, says which and why, and generates."""
    import torch
    from transformers import DynamicLayer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                      intermediate_size=256, vocab_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvcx")
    cache = KvcxCache(cfg, scheme="turboquant_4bit_nc", residual_length=16)
    assert [type(layer) for layer in cache.layers] == [DynamicLayer] * 2 + [KvcxLayer] * 2 + [DynamicLayer] * 2
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    report = cache.memory_report()
    rows = report["layers"]
    assert [r["kvcx"] for r in rows] == ["kept"] * 2 + ["packed"] * 2 + ["kept"] * 2
    assert "vLLM's TurboQuant" in rows[0]["kept_because"] and rows[2]["tokens_held"] == 43
    assert report["kept_bytes"] == sum(r["bytes"] for r in rows if r["kvcx"] == "kept") > 0


@pytest.mark.parametrize("name", [n for n in FAMILIES if "Qwen 3.5" in n or "Gemma 3" in n])
def test_layer_kwargs_as_transformers_before_5_19_gives_them(name, monkeypatch):
    """transformers before 5.19 returns one dict of cache-layer kwargs that every layer class is given (5.19: a list,
    a dict a layer): the layers kvcx leaves to transformers are built from either (5.17 on the H200 raised a KeyError
    on every hybrid model before this)."""
    import transformers.cache_utils as cu

    cfg = FAMILIES[name]()
    real = cu.get_layer_types_and_kwargs
    merged = {k: v for d in real(cfg)[1] for k, v in d.items()}

    def one_dict(config):   # 5.17's shape: the layers' kwargs merged into one
        types, kwargs = real(config)
        return types, {k: v for d in kwargs for k, v in d.items()}

    before = [type(layer) for layer in KvcxCache(cfg).layers]
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs", one_dict)
    after = KvcxCache(cfg)
    assert [type(layer) for layer in after.layers] == before
    assert all(layer_kwargs(cfg, s) == merged for s in layer_specs(cfg))
