"""KVConfig: tensor names to codecs, per-layer widths and variants, config round trips."""
import json

import pytest

from kvcx.codecs import KVConfig
from kvcx.codecs.kvconfig import is_key_tensor, layer_of
from kvcx.errors import CodecError

from helpers import plan_config


def test_layer_of_names():
    assert layer_of("layer_12_key") == 12
    assert layer_of("past_key_values.3.0") == 3
    assert layer_of("model.layers.7.self_attn.v_cache") == 7
    assert layer_of("blocks.2.k") == 2
    assert layer_of("key") is None and layer_of("player9_key") is None


def test_key_and_value_names():
    for name in ("layer_3_key", "k_cache.0", "model.layers.0.self_attn.k_proj", "past_key_values.0.0", "keys"):
        assert is_key_tensor(name), name
    for name in ("layer_3_value", "monkey_value", "past_key_values.0.1", "v_cache.1", "norm_weight", "hockey"):
        assert not is_key_tensor(name), name


def test_layer_bits_config_errors_and_json_round_trip():
    cfg = plan_config()
    assert KVConfig.from_config(json.loads(json.dumps(cfg.get_config()))) == cfg
    assert cfg.for_layer(5).value.bits == 3 and cfg.for_layer(5).key.bits == 4 and cfg.for_layer(0).key.bits == 3
    assert "5:4/3" in cfg.describe()
    # +1 bit (key 2), +1 (value 2), +1 (key 5), -0.75 (value 7: 2-bit asymmetric 2.5 vs 3-bit symmetric 3.25)
    assert abs(cfg.bits_per_value(22) - (22 * 3.375 + 2.25 / 2) / 22) < 1e-9
    base = KVConfig.from_scheme("kvcx3")
    for bad, msg in [([(1, 4)], "layer, key_bits, value_bits"), ([(1, 5, 3)], "not one of"),
                     ([(-1, 4, 4)], "layer -1"), ([(1, 4, 4), (1, 3, 3)], "twice"), (7, "must be a list"),
                     ([(1.5, 4, 4)], "layer 1.5"), ([(1, "b9x", 3)], "or the tag of one of the config's variants"),
                     ([(1, "b3zz", 3)], "does not define")]:
        with pytest.raises(CodecError, match=msg):
            KVConfig(key=base.key, value=base.value, layer_bits=bad, variants=base.variants)
    for bad, msg in [({"key.x": base.key}, "not a variant name"), ({"key.b4": base.key}, "codec of 4 bits"),
                     ([("value.b3",)], "must map")]:
        with pytest.raises(CodecError, match=msg):
            KVConfig(key=base.key, value=base.value, variants=bad)
    with pytest.raises(CodecError, match="variants must be an object"):
        KVConfig.from_config({**cfg.get_config(), "variants": [1]})
    for bad, msg in [({"key": {}}, "'key' and 'value'"), ({**cfg.get_config(), "extra": 1}, "unknown kvcx config"),
                     ({**cfg.get_config(), "scheme": 3}, "scheme must be a string")]:
        with pytest.raises(CodecError, match=msg):
            KVConfig.from_config(bad)


def test_latent_layers_code_an_mla_layers_rope_key_at_8_bits():
    """latent_layers names a model's MLA layers: their values (the shared RoPE key) get rope_key_codec() (a width
    per channel at 8 bits, the packed-file name value.rope), their keys (the latent) and every other layer the
    scheme's codecs; it survives the config's JSON, a backend and threads, and leaves the nominal bits as they are."""
    from kvcx.codecs import WidthCodec
    from kvcx.codecs.kvconfig import ROPE_NAME

    base = KVConfig.from_scheme()
    cfg = base.with_latent_layers([2, 0])
    assert cfg.latent_layers == (0, 2) and cfg.with_latent_layers(()) == base
    label, rope = cfg.codec_for("layer_2_value")
    assert label == ROPE_NAME and isinstance(rope, WidthCodec) and rope.bits == 8
    assert rope.group_size == base.key.token_block and rope.sinks == base.value.sinks
    assert cfg.codec_for("layer_2_key") == ("key", base.key) and cfg.codec_for("layer_1_value") == ("value", base.value)
    assert cfg.codecs() == {**base.codecs(), ROPE_NAME: rope}
    view = cfg.for_layer(0)
    assert view.key == base.key and view.value == rope and cfg.for_layer(1) == KVConfig(base.key, base.value, "kvcx")
    assert view.for_layer(0) == view and view.codec_for("layer_0_value") == ("value", rope)
    assert KVConfig.from_config(json.loads(json.dumps(cfg.get_config()))) == cfg
    assert cfg.get_config()["latent_layers"] == [0, 2] and "latent_layers" not in base.get_config()
    assert cfg.bits_per_value(4) == base.bits_per_value(4)
    assert "MLA layers 0, 2" in cfg.describe() and rope.describe() in cfg.describe()
    assert cfg.with_threads(1).for_layer(2).value.n_threads == 1
    assert cfg.with_backend("triton").for_layer(2).value.backend == "triton"
    assert base.rope_key_codec(128) == rope          # keys grouped per channel: their groups, whatever the residual
    per_token = KVConfig.from_scheme("symmetric")
    assert per_token.rope_key_codec(128).group_size == 128 and per_token.rope_key_codec().group_size == 64
    # a per-layer plan's selection: an 8-bit value stays as it is, a lower one becomes the RoPE key's codec
    plan = KVConfig(base.key, base.value, "kvcx", layer_bits=((0, 4, 8), (2, 4, 2))).with_latent_layers([0, 2])
    assert plan.for_layer(0).value.bits == 8 and plan.for_layer(0).value.codec_id == "kvcx.int"
    assert plan.for_layer(2).value == rope and plan.codec_for("layer_0_value")[0] == "value.b8"


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "q4_0", "turboquant_k8v4"])
def test_an_engines_format_codes_the_rope_key_as_the_engine_writes_it(scheme):
    base = KVConfig.from_scheme(scheme)
    cfg = base.with_latent_layers([0])
    assert cfg.codec_for("layer_0_value") == ("value", base.value) and cfg.codecs() == base.codecs()
    assert cfg.rope_key_codec() is base.value


def test_latent_layers_bad_input():
    from kvcx.codecs import WidthCodec

    for bad in ([-1], ["a"], 3, [1.5]):
        with pytest.raises(CodecError, match="latent_layers must be a list of layer indices"):
            KVConfig.from_scheme().with_latent_layers(bad) if bad != 3 else \
                KVConfig(KVConfig.from_scheme().key, KVConfig.from_scheme().value, latent_layers=bad)
    with pytest.raises(CodecError, match="per-channel widths are for keys"):   # widths values without an MLA layer
        KVConfig(KVConfig.from_scheme().key, WidthCodec(bits=8, group_size=64))
    with pytest.raises(CodecError, match="unknown kvcx config fields"):
        KVConfig.from_config({**KVConfig.from_scheme().get_config(), "latent": [0]})
