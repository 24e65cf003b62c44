"""KvcxCache.for_model: the retrieval guard found without data (the induction probe ranks the attention layers by how
much their heads copy; a tenth of them get 8-bit keys), and ``guard_layers`` for layers chosen by hand. On the tiny
random-weight families: the guard lands on the layers the probe ranks first, a hybrid's linear layers are never
guarded, the guarded cache decodes fused; schemes without integer keys are left as they are; bad options are one
KvcxError before the probe runs. The embedded model's guard (layers 17, 18, 20) is tests/quality/test_induction.py's.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.families import build, decode, family_configs, prompts  # noqa: E402
from kvcx.cache import KvcxCache  # noqa: E402
from kvcx.cache.induction import GUARD_SHARE, guard_count, induction_layers, induction_scores  # noqa: E402
from kvcx.codecs.kvconfig import GUARD_BITS, KVConfig  # noqa: E402
from kvcx.errors import KvcxError  # noqa: E402

WINDOW, PROMPT = 64, 512


def _model(name):
    cfg = family_configs(WINDOW, PROMPT)[name]()
    cfg.eos_token_id = None
    return build(cfg)


def test_a_tenth_of_the_attention_layers_rounded_at_least_one():
    assert [guard_count(n) for n in (1, 4, 14, 15, 16, 30, 32, 80)] == [1, 1, 1, 2, 2, 3, 3, 8]
    assert GUARD_SHARE == 10


@pytest.mark.parametrize("name,guard,scheme", [("Llama", None, "kvcx"), ("Llama", 2, "kvcx"), ("Gemma 4", None, "kvcx"),
                                               ("Qwen 3.5 (linear)", None, "kvcx"), ("Llama", 1, "kvcx2v"),
                                               ("Gemma 3", 2, "kvcx2w"), ("Llama", 1, "kvcx4w")])
def test_for_model_guards_the_layers_the_probe_ranks_first(name, guard, scheme):
    """Keys of integer codes (kvcx) or of a width per channel (kvcx2v, kvcx2w, kvcx4w): the guarded layers' keys are
    8 bits in every channel, grouped as the scheme's keys are (its widths' groups, its sinks), their values the
    scheme's."""
    model = _model(name)
    model.set_attn_implementation("kvcx")
    cache = KvcxCache.for_model(model, guard=guard, scheme=scheme)
    assert model.config._attn_implementation == "kvcx"          # the probe's eager forwards leave it as found
    attending = [s.index for s in cache.specs if s.packed]
    expected = induction_layers(induction_scores(model), guard or guard_count(len(attending)), among=attending)
    assert cache.guard_layers == tuple(sorted(expected)) and set(expected) <= set(attending)
    base = KVConfig.from_scheme(scheme)
    assert cache.kv_config == base.guarded(expected)
    group = base.key.group_size if scheme != "kvcx" else 64     # the default's keys: per channel in groups of 64
    for L in range(4):   # the guarded keys: a width per channel, every channel 8 bits (the codes the kernel reads)
        key = cache.kv_config.for_layer(L).key
        if L in expected:
            assert (key.codec_id, key.bits, key.group_size, key.sinks) == ("kvcx.widths", GUARD_BITS, group, 1)
        else:
            assert key == base.key
        assert cache.kv_config.for_layer(L).value == base.value
    assert cache.memory_report()["guard_layers"] == sorted(expected)
    if "linear" in name:
        assert cache.guard_layers == (3,)                       # the one full-attention layer; linear layers never
    ids, mask = prompts(1, 2 * WINDOW + 5)
    tokens, _ = decode(model, cache, ids, mask, 4)
    report = cache.memory_report()
    assert report["attention_steps"]["materialised"] == 0 and report["attention_steps"]["fused"] > 0
    by_hand, _ = decode(model, KvcxCache(model.config, scheme=scheme, guard_layers=expected), ids, mask, 4)
    assert torch.equal(tokens, by_hand)                         # the same cache as guard_layers by hand


@pytest.mark.parametrize("kwargs", [dict(guard=0), dict(scheme="q4_0"), dict(scheme="nvfp4"),
                                    dict(kv_config=KVConfig.from_scheme("kvcx").guarded([1])),
                                    dict(backend="triton"),    # the Triton kernels read 4-bit integer codes
                                    dict(scheme="kvcx2v"), dict(scheme="kvcx4w")])   # widths keys: when asked
def test_no_guard_unasked_but_on_integer_keys(kwargs):
    model = _model("Llama")
    cache = KvcxCache.for_model(model, **kwargs)
    plain = KvcxCache(model.config, **{k: v for k, v in kwargs.items() if k != "guard"})
    assert cache.guard_layers == () and cache.kv_config == plain.kv_config


@pytest.mark.parametrize("kwargs,message", [
    (dict(guard=-1), "0 to the model's 4"), (dict(guard=5), "0 to the model's 4"), (dict(guard=True), "guard=True"),
    (dict(guard=1.5), "guard=1.5"), (dict(guard=2, scheme="q4_0"), "or guard=0"),
    (dict(guard=1, kv_config=KVConfig.from_scheme("kvcx").guarded([1])), "not a plan"),
    (dict(guard_layers=[1]), "pass guard="),
    (dict(guard=1, bits=5), "bits"),
])
def test_bad_for_model_options_are_refused_before_the_probe(kwargs, message):
    model = _model("Llama")
    with pytest.raises(KvcxError, match=message):
        KvcxCache.for_model(model, **kwargs)


def test_a_guard_on_the_triton_backend_keeps_its_records_on_the_device():
    """backend="triton" with guard=1: the guarded layer's 8-bit widths keys are encoded and decoded on the device
    (DeviceChunkKV, the widths codec's Triton kernels: its steps materialised, said by a SlowPathWarning), the other
    layers run fused over DevicePackedKV; the guarded layer's records decode to the CPU store's values bit for bit,
    so its greedy tokens are the CPU path's."""
    from kvcx.cache.device_store import DeviceChunkKV, DevicePackedKV
    from kvcx.errors import SlowPathWarning

    model = _model("Llama")
    model.set_attn_implementation("kvcx")
    with pytest.warns(SlowPathWarning, match="decode their packed context on the device each step"):
        cache = KvcxCache.for_model(model, guard=1, backend="triton")
    (guarded,) = cache.guard_layers
    ids, mask = prompts(1, 2 * WINDOW + 5)
    tokens, _ = decode(model, cache, ids, mask, 4)
    for layer in cache.layers:
        want = DeviceChunkKV if layer.layer_idx == guarded else DevicePackedKV
        assert isinstance(layer.store, want) and layer.on_device, (layer.layer_idx, type(layer.store))
        assert layer.steps["materialised" if layer.layer_idx == guarded else "fused"] == 3
    assert cache.backend == "triton" and "decodes its packed context there" in cache.layers[guarded].fused_unsupported
    cpu = KvcxCache(model.config, guard_layers=[guarded], backend="cpu")
    by_cpu, _ = decode(model, cpu, ids, mask, 4)
    assert torch.equal(tokens, by_cpu)
    out = torch.empty(1, model.config.num_key_value_heads, cpu.layers[guarded].store.tokens,
                      model.config.head_dim, dtype=torch.float32)
    got = torch.empty_like(out)
    cpu.layers[guarded].store.keys.decode_into(out.numpy(), name="key")
    cache.layers[guarded].store.decode_into("key", got)
    assert torch.equal(out, got)


def test_a_hybrids_linear_layers_are_not_counted():
    with pytest.raises(KvcxError, match="0 to the model's 1 "):
        KvcxCache.for_model(_model("Qwen 3.5 (linear)"), guard=2)


@pytest.mark.parametrize("layers,message", [([4], "4 is not a layer this cache packs"), ([1, 1], "each layer once"),
                                            (["1"], "'1' is not a layer"), ([True], "True is not a layer"),
                                            ([0], "linear")])
def test_bad_guard_layers_are_refused(layers, message):
    name = "Qwen 3.5 (linear)" if message == "linear" else "Llama"
    config = family_configs(WINDOW, PROMPT)[name]()
    with pytest.raises(KvcxError, match="0 is not a layer" if message == "linear" else message):
        KvcxCache(config, guard_layers=layers)
    with pytest.raises(KvcxError, match="not a plan or an engine's format"):
        KvcxCache(family_configs(WINDOW, PROMPT)["Llama"](), scheme="q4_0", guard_layers=[1])


def test_the_guards_key_groups_set_the_residual():
    """The guard's keys are grouped by the scheme's per-channel key groups, or by 64 tokens where the scheme groups
    keys per token: the residual (full-precision tokens before packing) holds whole groups of every layer's codecs."""
    config = family_configs(WINDOW, PROMPT)["Llama"]()
    assert KvcxCache(config, scheme="symmetric", guard_layers=[1]).residual_length == 64
    assert KvcxCache(config, group_size=128, guard_layers=[1]).residual_length == 128
    with pytest.raises(KvcxError, match=r"residual_length \(32\) must be a multiple of the group size \(64\)"):
        KvcxCache(config, scheme="symmetric", residual_length=32, guard_layers=[1])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", ["Gemma 3", "GPT-OSS", "Llama 4 (chunked)"])
def test_guarded_windowed_layers_wrap_their_ring_fused_8_windows_in(name, batch, checked):
    """Every attention layer guarded (the sliding and chunked ones among them), a prompt of 8x the window (the rings
    wrap 8 times) at batch 1 and left-padded at batch 3: every decode step fused and equal to the reference attention
    over the same context within FP32 rounding, a windowed layer holds at most its window, one packed chunk and the
    residual, and teacher-forced on DynamicCache's tokens the distributions are within the families' KL bound
    (tests/cache/test_families.py's: the default scheme's KLD on the embedded model)."""
    from transformers import DynamicCache

    from bench.families import kl, temper

    steps = 4
    model = temper(_model(name), name)
    ids, mask = prompts(batch, 8 * WINDOW)
    model.set_attn_implementation("eager")
    ref_tokens, ref_logits = decode(model, DynamicCache(config=model.config), ids, mask, steps)
    model.set_attn_implementation("kvcx")
    packed = [s.index for s in KvcxCache(model.config).specs if s.packed]
    cache = KvcxCache.for_model(model, guard=len(packed))
    assert cache.guard_layers == tuple(packed)
    assert any(s.window for s in cache.specs if s.index in cache.guard_layers)
    _, logits = decode(model, cache, ids, mask, steps, forced=ref_tokens)
    report = cache.memory_report()
    assert report["attention_steps"] == {**report["attention_steps"], "materialised": 0,
                                         "fused": (steps - 1) * len(packed)}
    assert len(checked) == (steps - 1) * len(packed)
    worst = max(checked, key=lambda r: r[1] / r[2])
    assert worst[1] <= 2e-5 * worst[2], worst
    for spec, layer in zip(cache.specs, report["layers"]):
        if spec.window:
            assert layer["tokens_held"] <= spec.window + 2 * cache.residual_length, layer
    assert kl(ref_logits, logits) <= 0.003
