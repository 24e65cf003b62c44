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
