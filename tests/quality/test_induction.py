"""The induction probe (kvcx calibrate --guard-induction): the heads that copy on random tokens fed twice, found
without data, and the plan that gives their layers 8-bit keys; on the embedded model they are the layers the
measured retrieval guard chose (17, 18, 20); on every family's tiny model the probe runs (a hybrid's linear layers
score 0); bad input is one red line before the model loads."""
import numpy as np
import pytest
from helpers import run

from bench.families import build, family_configs
from kvcx.api import load_plan, read_plan
from kvcx.cache import KvcxCache
from kvcx.codecs.kvconfig import KVConfig
from kvcx.errors import KvcxError
from kvcx.quality.guard import GUARD_BITS
from kvcx.quality.induction import check_induction, induction_guard, induction_layers, induction_scores


def test_on_the_embedded_model_the_probe_finds_the_retrieval_guards_layers(loaded, tmp_path):
    """The measured guard (--guard-retrieval 8192: passkey prompts, the loss layer by layer) chose the keys of
    layers 17, 18 and 20 (bench/plans/measured/kvcx-layers17-18-20-keys8.json); the probe ranks the same three
    first, from random tokens, and leaves the model's attention as it found it."""
    from kvcx.api import save_plan

    model = loaded[0]
    before = model.config._attn_implementation
    base = KVConfig.from_scheme("kvcx")
    guard = induction_guard(base, 3, loaded=loaded)
    assert model.config._attn_implementation == before
    assert guard.layers == [18, 17, 20]
    assert guard.scores.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    assert guard.config == base.guarded([17, 18, 20])
    measured = load_plan("bench/plans/measured/kvcx-layers17-18-20-keys8.json")   # (written with 8-bit integer keys)
    assert [L for L, _, _ in measured.layer_bits] == [L for L, _, _ in guard.config.layer_bits] == [17, 18, 20]
    assert guard.bits_per_value == pytest.approx(base.bits_per_value(30) + 3 * (GUARD_BITS + 0.25 - 4.5) / 2 / 30)
    for scheme in ("kvcx", "kvcx2v"):   # the probe's plans the benches read (docs/results/low-bits.md, ...)
        shipped = load_plan(f"bench/plans/measured/{scheme}-induction3.json")
        assert shipped == KVConfig.from_scheme(scheme).guarded(guard.layers)
    cache = KvcxCache.for_model(model)   # the same probe in memory: a tenth of the 30 layers
    assert cache.guard_layers == (17, 18, 20) and cache.kv_config == guard.config
    assert model.config._attn_implementation == before
    best = guard.scores.max(-1)
    assert best[18] > 0.5 and best[17] > 0.5 and np.median(best) < 0.05   # a few heads copy; most do not
    path = tmp_path / "induction.json"
    save_plan(path, guard)
    record = read_plan(path)
    assert record["induction"]["layers"] == [18, 17, 20] and load_plan(path) == guard.config


@pytest.mark.parametrize("name", ["Llama", "Gemma 4", "Qwen 3.5 (linear)"])
def test_the_probe_runs_on_the_families(name):
    """Random weights hold no induction heads (every score near 1 / position); the probe still scores every layer,
    a hybrid's linear layers at 0 (they return no attention weights)."""
    model = build(family_configs(64, 512)[name]())
    scores = induction_scores(model, tokens=32, trials=1)
    assert scores.shape == (4, 4) and np.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()
    if "linear" in name:
        assert (scores[:3] == 0).all() and scores[3].max() > 0
    assert induction_layers(scores, 4) == sorted(range(4), key=lambda i: -scores[i].max())



def test_the_plan_guards_a_hybrids_attention_layers_only():
    """``--guard-induction`` ranks the layers that hold keys and values, as KvcxCache.for_model does: on Qwen 3.5's
    tiny model (3 linear layers, 1 full) the one full layer, and no more than it has."""
    model = build(family_configs(64, 512)["Qwen 3.5 (linear)"]())
    base = KVConfig.from_scheme("kvcx")
    guard = induction_guard(base, 1, loaded=(model, None, "qwen3.5-tiny"))
    assert guard.layers == [3] and guard.config == base.guarded([3])
    assert guard.config == KvcxCache.for_model(model).kv_config
    with pytest.raises(KvcxError, match="between 1 and the model.s 1 attention layers"):
        induction_guard(base, 2, loaded=(model, None, "qwen3.5-tiny"))

def test_bad_probe_settings_are_refused():
    scores = np.zeros((30, 9))
    for n in (0, 31):
        with pytest.raises(KvcxError, match="between 1 and the model.s 30 attention layers"):
            induction_layers(scores, n)
    check_induction(KVConfig.from_scheme("kvcx2v"))   # keys of a width per channel take the guard too
    with pytest.raises(KvcxError, match="an engine's format"):
        check_induction(KVConfig.from_scheme("nvfp4"))
    with pytest.raises(KvcxError, match="not a plan"):
        check_induction(load_plan("bench/plans/measured/kvcx-layers17-18-20-keys8.json"))


@pytest.mark.parametrize("extra,message", [
    (["--guard-induction", "3", "--budget", "3"], "leave out --budget"),
    (["--guard-induction", "3", "--guard-retrieval", "8192"], "leave out --guard-retrieval"),
    (["--guard-induction", "3", "--prompts", "4"], "leave out --prompts"),
    (["--guard-induction", "3", "--scheme", "kvcx+snapkv:0.5"], "without its press"),
    (["--guard-induction", "3", "--scheme", "mxfp4"], "an engine's format"),
    (["--guard-induction", "3", "--scheme", "q4_0"], "an engine's format"),
    (["--guard-induction", "0"], "at least 1 layer"),
])
def test_bad_induction_options_are_one_red_line_before_the_model_loads(tmp_path, extra, message):
    r = run("calibrate", "--out", tmp_path / "p.json", *extra)
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("record", [{"scores": "x"}, {"layers": [1, float("nan")]}, {"tokens": "many"},
                                    {"scores": [[0.1, "a"]]}, {"other": 1}])
def test_a_damaged_induction_record_is_refused(tmp_path, record):
    import json

    from kvcx.errors import FormatError

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"config": KVConfig.from_scheme("kvcx").get_config(), "induction": record}))
    with pytest.raises(FormatError, match="'induction' must be the induction probe's record"):
        read_plan(path)
