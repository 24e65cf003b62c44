"""The retrieval guard (kvcx calibrate --guard-retrieval): the rule, the config it gives, bad input before the model
loads, and a real measurement on the embedded model."""
import json

import pytest
from helpers import run

from kvcx.api import load_plan, read_plan
from kvcx.codecs.kvconfig import KVConfig
from kvcx.errors import KvcxError
from kvcx.quality.guard import GUARD_BITS, check_guard, guard_config, guarded_layers


def test_a_layer_is_guarded_when_its_keys_alone_carry_the_share_of_the_loss():
    losses = [0.001, 0.05, 0.0, 0.02, -0.01]
    assert guarded_layers(losses, 0.1, 0.15) == [1, 3]
    assert guarded_layers(losses, 0.1, 0.3) == [1]
    assert guarded_layers(losses, 0.1, 0.9) == []
    assert guarded_layers(losses, -0.01) == [] and guarded_layers(losses, 0.0) == []   # no loss: nothing to guard
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(KvcxError, match="protect"):
            guarded_layers(losses, 0.1, bad)


def test_the_guarded_layers_get_8_bit_keys_and_keep_their_values():
    base = KVConfig.from_scheme("kvcx3")
    cfg = guard_config(base, [18, 2])
    assert [L for L, _, _ in cfg.layer_bits] == [2, 18] and all(vb == 3 for _, _, vb in cfg.layer_bits)
    guarded = cfg.for_layer(18).key   # 8 bits in every channel, the keys' groups and sinks (the fused kernel reads it)
    assert (guarded.codec_id, guarded.bits, guarded.group_size, guarded.sinks) == ("kvcx.widths", GUARD_BITS, 64, 1)
    assert cfg.for_layer(18).value == base.value and cfg.for_layer(3).key == base.key
    # 8 bits + two bytes of range per channel and 64 tokens, against 3 bits + an FP16 scale and zero point per 64
    assert guarded.bits_per_value() == 8 + 16 / 64 and base.key.bits_per_value() == 3 + 32 / 64
    assert cfg.bits_per_value(30) == pytest.approx(base.bits_per_value(30) + 2 * (8.25 - 3.5) / 2 / 30)
    with pytest.raises(KvcxError, match="not a plan"):
        guard_config(cfg, [1])


@pytest.mark.parametrize("kw,message", [
    (dict(length=100), "at least"), (dict(prompts=0), "--prompts"), (dict(depths=[1.5]), "depths"),
    (dict(depths=[]), "depths"), (dict(protect=2.0), "protect"),
    (dict(config=KVConfig.from_scheme("mxfp4")), "an engine's format"),
    (dict(config=KVConfig.from_scheme("q4_0")), "an engine's format"),   # was an AttributeError after the prompts
])
def test_bad_guard_settings_are_refused(kw, message):
    args = dict(config=KVConfig.from_scheme("kvcx"), length=8192, prompts=8, depths=[0.9], protect=0.15)
    args.update(kw)
    with pytest.raises(KvcxError, match=message):
        check_guard(**args)


@pytest.mark.parametrize("extra,message", [
    (["--guard-retrieval", "100"], "at least"),
    (["--guard-retrieval", "8192", "--budget", "3"], "leave out --budget"),
    (["--guard-retrieval", "8192", "--windows", "2"], "leave out --windows"),
    (["--guard-retrieval", "8192", "--scheme", "kvcx+snapkv:0.5"], "without its press"),
    (["--guard-retrieval", "8192", "--prompts", "0"], "--prompts"),
    (["--guard-retrieval", "8192", "--scheme", "q4_0"], "an engine's format"),
    (["--guard-retrieval", "8192", "--protect", "0"], "protect"),
    (["--guard-retrieval", "8192", "--scheme", "nvfp4"], "an engine's format"),
    (["--scheme", "kvcx3"], "--budget is missing"),
])
def test_bad_guard_options_are_one_red_line_before_the_model_loads(tmp_path, extra, message):
    r = run("calibrate", "--out", tmp_path / "p.json", *extra)
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "p.json").exists()


def test_the_guard_measures_each_layers_keys_on_the_model(loaded, tmp_path):
    """At 1,024 tokens: 8-bit keys lose next to nothing in any layer, 2-bit keys lose more in all; the plan file
    is a plan validate and load_plan read, its layers those the rule picks from the figures it records."""
    from kvcx.api import save_plan
    from kvcx.quality.guard import measure_guard

    fine = measure_guard(KVConfig.from_scheme("kvcx", bits=8), length=1024, prompts=1, loaded=loaded)
    coarse = measure_guard(KVConfig.from_scheme("kvcx2"), length=1024, prompts=1, loaded=loaded)
    n = loaded[0].config.num_hidden_layers
    assert len(fine.losses) == len(coarse.losses) == n
    assert max(abs(x) for x in fine.losses) < 0.05 and abs(fine.whole) < 0.05
    assert coarse.whole > abs(fine.whole) and coarse.whole > 0.05
    assert coarse.layers == guarded_layers(coarse.losses, coarse.whole)
    path = tmp_path / "guard.json"
    save_plan(path, coarse)
    record = read_plan(path)
    assert record["guard"]["layers"] == coarse.layers and record["n_layers"] == n
    assert load_plan(path) == coarse.config
    assert {L for L, kb, _ in coarse.config.layer_bits} == set(coarse.layers)
    bad = dict(record, guard={**record["guard"], "losses": "x"})
    path.write_text(json.dumps(bad))
    r = run("validate", "--plan", path, "--task", "passkey")
    assert r.exit_code == 1 and "'guard'" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("scheme", ["kvcx2v", "kvcx2w"])
def test_a_widths_key_scheme_takes_the_guard_and_a_packed_file_keeps_it(scheme):
    """Keys of a width per channel (kvcx2v: E8P values; kvcx2w): the guarded layers' keys are 8 bits in every channel
    in the scheme's own key groups, their values the scheme's; the plan goes through its record and a packed file
    (each guarded layer's keys under the variant's name, decoding as finely as 8 bits do)."""
    from helpers import tinyllama_cache

    from kvcx.codecs.metrics import error_stats
    from kvcx.formats.packed import compress_tensors, decompress_tensors

    base = KVConfig.from_scheme(scheme)
    cfg = guard_config(base, [2])
    key = cfg.for_layer(2).key
    assert (key.codec_id, key.bits, key.group_size, key.sinks) == ("kvcx.widths", GUARD_BITS, base.key.group_size,
                                                                    base.key.sinks)
    assert cfg.for_layer(2).value == base.value and cfg.for_layer(0) == KVConfig(base.key, base.value, scheme=scheme)
    assert cfg.bits_per_value(8) == pytest.approx(base.bits_per_value(8) + (key.bits_per_value()
                                                                           - base.key.bits_per_value()) / 2 / 8)
    assert KVConfig.from_config(json.loads(json.dumps(cfg.get_config()))) == cfg
    tensors = {n: a for n, a in tinyllama_cache(seq=128).items() if n.startswith(("layer_0_", "layer_2_"))}
    packed, meta, _ = compress_tensors(tensors, cfg)
    info = json.loads(meta["kvcx.tensors"])
    assert info["layer_2_key"]["codec"] == "key.b8w" and info["layer_0_key"]["codec"] == "key"
    assert info["layer_2_value"]["codec"] == info["layer_0_value"]["codec"] == "value"
    out = decompress_tensors(packed, meta)
    snr = {n: error_stats(tensors[n], out[n]).snr_db for n in ("layer_0_key", "layer_2_key")}
    assert snr["layer_2_key"] > 40 > snr["layer_0_key"], snr


def test_widths_keys_take_per_layer_selections_of_widths_keys_alone():
    """A widths config selects per layer only widths keys (a plan's mean widths, the guard's 8 bits), its values
    the scheme's codec; a tag names its width (b2hw = 2.5 bits) and the variant must be a widths codec of it."""
    from kvcx.codecs import WidthCodec
    from kvcx.codecs.kvconfig import widths_bits, widths_tag
    from kvcx.errors import CodecError

    base = KVConfig.from_scheme("kvcx2v")
    guard = base.guarded([1]).variants
    for layer_bits, variants in (([(0, 4, 2)], ()), ([(0, "b8w", 3)], guard), ([(0, "b8w", 2), (1, 4, 2)], guard)):
        with pytest.raises(CodecError, match="widths key codec .* selections of widths keys alone"):
            KVConfig(key=base.key, value=base.value, layer_bits=layer_bits, variants=variants)
    assert [widths_tag(b) for b in (1, 1.5, 2.5, 4, 8)] == ["b1w", "b1hw", "b2hw", "b4w", "b8w"]
    assert [widths_bits(t) for t in ("b1w", "b1hw", "b2hw", "b8w", "b3", "b3g128")] == [1, 1.5, 2.5, 8, None, None]
    for bad in (0.5, 1.25, 5, 9):
        with pytest.raises(CodecError, match="1, 1.5, ... 4 or 8 bits"):
            widths_tag(bad)
    half = WidthCodec(bits=2.5, group_size=64, sinks=1)
    plan = KVConfig(key=base.key, value=base.value, variants={"key.b2hw": half}, layer_bits=[(3, "b2hw", 2)])
    assert plan.for_layer(3).key == half and plan.for_layer(2).key == base.key
    assert plan.bits_per_value(4) == pytest.approx((3 * base.key.bits_per_value() + 2.75 + 4 * 2.25) / 8)
    with pytest.raises(CodecError, match=r"'key.b2hw' must be a widths codec of 2.5 bits .* got 2.0"):
        KVConfig(key=base.key, value=base.value, variants={"key.b2hw": WidthCodec(bits=2, group_size=64)})
    assert KVConfig(key=base.key, value=base.value, scheme="kvcx2v", layer_bits=[(1, "b8w", 2)],
                    variants=guard) == base.guarded([1])
    for scheme in ("nvfp4", "q4_0", "turboquant_k8v4"):   # an engine's keys: no guard to give them
        with pytest.raises(CodecError, match="not an engine's format"):
            KVConfig.from_scheme(scheme).guarded([1])
