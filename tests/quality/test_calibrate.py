"""kvcx calibrate: the exact knapsack, measuring on the model, re-allocating from saved figures."""
import json

import numpy as np
import pytest

from kvcx.api import load_plan, read_plan
from kvcx.codecs import KVConfig
from kvcx.errors import KvcxError
from kvcx.quality.calibrate import allocate

from helpers import run


def test_allocate_spends_the_budget_where_sensitivity_is():
    preset = KVConfig.from_scheme("kvcx3")
    base = KVConfig(key=preset.key, value=preset.value, scheme="kvcx3")   # no variants: widths 3 and 4
    sens = {(k, L): 1e-4 for L in range(10) for k in ("key", "value")}
    sens[("key", 4)] = 0.05
    sens[("value", 8)] = 0.02
    plan, est, guessed = allocate(sens, base, 10, budget=3.375 + 3 / 20)   # room for exactly 3 one-bit raises
    widths = {L: (kb, vb) for L, kb, vb in plan.layer_bits}
    assert widths[4][0] == 4 and widths[8][1] == 4 and len(plan.layer_bits) == 3
    assert plan.bits_per_value(10) <= 3.375 + 3 / 20 + 1e-9
    # nothing measured above 3 bits: every 4-bit figure is the 3-bit one / 4
    assert est == pytest.approx(sum(sens.values()) - 0.75 * (0.05 + 0.02 + 1e-4)) and guessed == 3
    same, est0, _ = allocate(sens, base, 10, budget=3.375)
    assert same.layer_bits == () and est0 == pytest.approx(sum(sens.values()))
    with pytest.raises(KvcxError, match="at or above the 3.375"):
        allocate(sens, base, 10, budget=3.0)
    with pytest.raises(KvcxError, match="no sensitivity measured for values of layer 9"):
        allocate({k: v for k, v in sens.items() if k != ("value", 9)}, base, 10, budget=3.5)


def test_allocate_is_the_exact_optimum_of_the_measured_figures():
    """The knapsack against brute force over every choice of the presets' options (keys: 2, 3, 4 bits in
    groups of 64 and 3, 4 in groups of 128; values: asymmetric 2 bits, symmetric or asymmetric 3 and 4)."""
    import itertools

    base = KVConfig.from_scheme("kvcx2")
    opts = {k: base.options(k) for k in ("key", "value")}
    assert sorted(opts["key"]) == ["b2", "b3", "b3g128", "b4", "b4g128"]
    assert sorted(opts["value"]) == ["b2", "b3", "b3a", "b4", "b4a"]
    assert base.codec_at("value", 3).scheme == "symmetric" and base.codec_at("value", "b3a").scheme == "asymmetric"
    assert base.codec_at("key", "b3g128").group_size == 128 and base.codec_at("value", 2) == base.value
    cost = {(k, t): base.codec_at(k, t if not t[1:].isdigit() else int(t[1:])).bits_per_value()
            for k in opts for t in opts[k]}
    assert cost[("key", "b3g128")] == 3.25 and cost[("value", "b3")] == 3.25 and cost[("value", "b3a")] == 3.5
    rng = np.random.default_rng(7)
    n = 2
    items = [(k, L) for L in range(n) for k in ("key", "value")]
    sens = {}
    for k, L in items:   # more bits/value, less KLD, by uneven factors the 4x rule would misjudge
        a = rng.uniform(1e-4, 0.05)
        for t in opts[k]:
            sens[(k, L, t)] = a * 4.0 ** -(cost[(k, t)] - 2.5) * rng.uniform(0.3, 3.0)
    for budget in (2.5, 2.7, 3.0, 3.3, 3.6, 4.0, 4.5):
        best = min((sum(sens[(k, L, t)] for (k, L), t in zip(items, ts)), ts)
                   for ts in itertools.product(*(opts[k] for k, _ in items))
                   if sum(cost[(k, t)] for (k, _), t in zip(items, ts)) / len(items) <= budget + 1e-9)
        plan, est, guessed = allocate(sens, base, n, budget)
        assert est == pytest.approx(best[0]) and guessed == 0, budget
        got = {L: (kb, vb) for L, kb, vb in plan.layer_bits}
        chosen = [t if isinstance(t, str) else f"b{t}" for L in range(n) for t in got.get(L, (2, 2))]
        assert chosen == list(best[1]), budget
        assert plan.bits_per_value(n) <= budget + 1e-9
        for L in range(n):   # the plan's layers get the chosen codecs
            for k, t in zip(("key", "value"), chosen[2 * L:2 * L + 2]):
                assert getattr(plan.for_layer(L), k) == base.codec_at(k, t if not t[1:].isdigit() else int(t[1:]))


@pytest.mark.model
def test_calibrate_measures_every_layer_and_writes_a_plan(loaded, wikitext_path, tmp_path):
    from kvcx.api import save_plan
    from kvcx.quality import calibrate as cal

    res = cal.run_calibration(KVConfig.from_scheme("kvcx2"), budget=2.7, dataset_file=wikitext_path, windows=1,
                              offset=3, window=192, stride=64, loaded=loaded, options=["b2", "b3", "b4"])
    n = res.n_layers
    assert set(res.sensitivity) == {(k, L, t) for L in range(n) for k in ("key", "value") for t in ("b2", "b3", "b4")}
    assert all(v >= 0 for v in res.sensitivity.values()) and max(res.sensitivity.values()) > 0
    assert res.tokens == 63 and res.bits_per_value <= 2.7 + 1e-9 and res.config.layer_bits
    # more bits, less damage: summed over layers, each width measurably better than the one below
    total = {t: sum(v for (k, L, w), v in res.sensitivity.items() if w == t) for t in ("b2", "b3", "b4")}
    assert total["b2"] > total["b3"] > total["b4"] > 0, total
    # the most sensitive (kind, layer) at 2 bits got more
    top = max(res.base_sensitivity(), key=res.base_sensitivity().get)
    got = {L: tuple(s if isinstance(s, str) else f"b{s}" for s in sel) for L, *sel in res.config.layer_bits}
    assert got[top[1]][0 if top[0] == "key" else 1] != "b2"
    path = tmp_path / "plan.json"
    save_plan(path, res)
    assert load_plan(path) == res.config
    assert json.loads(path.read_text())["sensitivity"][0].keys() == {"kind", "layer", "option", "kld"}
    # the plan's estimate: measured figures where it chose a measured option, 4x per bit/value from them elsewhere
    chosen = [(k, L, got.get(L, ("b2", "b2"))[i]) for L in range(n) for i, k in enumerate(("key", "value"))]
    assert res.extrapolated == sum(c not in res.sensitivity for c in chosen)
    if res.extrapolated == 0:
        assert res.estimated_kld == pytest.approx(sum(res.sensitivity[c] for c in chosen))
    # one kind's options alone: the figures are kept (no plan yet) and --reuse combines them with the rest
    part = cal.run_calibration(KVConfig.from_scheme("kvcx2"), budget=2.7, dataset_file=wikitext_path, windows=1,
                               offset=3, window=192, stride=64, loaded=loaded, options=["value.b3a"])
    assert not part.complete and set(part.sensitivity) == {("value", L, "b3a") for L in range(n)}
    assert part.config.layer_bits == () and part.to_dict()["estimated_kld"] is None
    both = cal.reallocate([res.to_dict(), part.to_dict()], 3.0)
    assert {t for _, _, t in both.sensitivity} == {"b2", "b3", "b4", "b3a"}
    assert all(both.sensitivity[("value", L, "b3a")] == part.sensitivity[("value", L, "b3a")] for L in range(n))
    with pytest.raises(KvcxError, match="not a plan"):
        cal.run_calibration(res.config, budget=3.0, dataset_file=wikitext_path, loaded=loaded)


@pytest.mark.model
def test_calibrate_spends_a_budget_on_kvcx2v_keys_layer_by_layer(loaded, wikitext_path, tmp_path):
    """A plan over kvcx2v (E8P values, keys with a width per channel): the queries weigh the keys' channels, each
    layer's keys are measured alone at each mean width (the rest exact), and the budget goes to the layers' widths
    beside the values' 2.25 bits: the knapsack's choice is the least summed KLD of every choice within the budget
    (checked against the choices one layer at a time a width up or down). The plan compresses a cache, round-trips
    through a file, and --reuse reallocates it without the model."""
    from kvcx.api import save_plan
    from kvcx.codecs import E8PCodec
    from kvcx.codecs.kvconfig import widths_bits
    from kvcx.quality import calibrate as cal
    from kvcx.quality.bridge import roundtrip_tensors
    from kvcx.quality.width_plans import WIDTH_OPTIONS, width_tags

    assert [widths_bits(t) for t in width_tags()] == list(WIDTH_OPTIONS)   # what a plan measures by default
    res = cal.run_calibration(KVConfig.from_scheme("kvcx2v"), budget=2.2, dataset_file=wikitext_path, windows=1,
                              offset=3, window=192, stride=64, loaded=loaded, options=["b1w", "key.b2hw", "b3w"])
    cfg, n = res.config, res.n_layers
    assert cfg.value == E8PCodec(sinks=1) and len(cfg.key_weights) == n and len(cfg.layer_bits) == n
    tags = sorted({t for _, _, t in res.sensitivity}, key=widths_bits)
    assert tags == ["b1w", "b2hw", "b3w"]
    assert set(res.sensitivity) == {("key", L, t) for L in range(n) for t in tags}
    picked = {L: kb for L, kb, vb in cfg.layer_bits if vb == 2}
    widths = [widths_bits(picked[L]) for L in range(n)]
    assert len(set(widths)) > 1 and res.bits_per_value <= 2.2 + 1e-9   # the layers differ; within the budget
    assert res.bits_per_value == pytest.approx((sum(widths) / n + 16 / 64 + 2.25) / 2)
    assert res.estimated_kld == pytest.approx(sum(res.sensitivity[("key", L, picked[L])] for L in range(n)))
    for L in range(n):   # no single move of one layer's width within the budget lowers the summed KLD
        for t in tags:
            cost = (sum(widths) - widths[L] + widths_bits(t)) / n
            if cost <= sum(widths) / n + 1e-9:
                assert res.sensitivity[("key", L, t)] >= res.sensitivity[("key", L, picked[L])] - 1e-12, (L, t)
    # the plan's layers compress with their own widths, weighed by the queries
    rng = np.random.default_rng(0)
    cache = {f"layer_{L}_{k}": rng.standard_normal((1, 3, 96, 64)).astype(np.float16) for L in (0, 1)
             for k in ("key", "value")}
    decoded, nbytes, stats = roundtrip_tensors(cache, cfg)
    assert set(decoded) == set(cache) and stats.snr_db > 3
    path = tmp_path / "plan.json"
    save_plan(path, res)
    assert load_plan(path) == cfg
    again = cal.reallocate(json.loads(path.read_text()), 2.5)   # the saved figures, another budget, no model
    assert again.bits_per_value <= 2.5 + 1e-9 and again.bits_per_value > res.bits_per_value
    assert again.sensitivity == res.sensitivity and again.config.key_weights == cfg.key_weights
    with pytest.raises(KvcxError, match="tagged b1w, b1hw, b2w"):
        cal.run_calibration(KVConfig.from_scheme("kvcx2v"), budget=2.2, dataset_file=wikitext_path, loaded=loaded,
                            options=["b2"])
    with pytest.raises(KvcxError, match="below the 1.750"):
        cal.run_calibration(KVConfig.from_scheme("kvcx2v"), budget=1.6, dataset_file=wikitext_path, loaded=loaded)


def test_calibrate_reuse_reallocates_without_a_model(tmp_path):
    from kvcx.quality.calibrate import reallocate

    base = KVConfig.from_scheme("kvcx2")
    sens = [{"kind": k, "layer": L, "kld": (0.05 if (k, L) == ("key", 3) else 1e-4)} for L in range(6)
            for k in ("key", "value")]
    saved = {"config": base.get_config(), "sensitivity": sens, "n_layers": 6, "windows": 4, "tokens": 2044}
    src = tmp_path / "measured.json"
    src.write_text(json.dumps(saved))
    out = tmp_path / "plan.json"
    r = run("calibrate", "--reuse", src, "--budget", 2.5 + 2 / 12, "--out", out)
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.layer_bits[0] == (3, 4, 2) and plan.bits_per_value(6) <= 2.5 + 2 / 12 + 1e-9
    again = reallocate(json.loads(out.read_text()), 2.5 + 2 / 12)
    assert again.config == plan     # a plan file is itself a source: its base config has no layer widths
    assert reallocate(saved, 3.5).config.bits_per_value(6) == pytest.approx(3.5, abs=1 / 12)
    for bad, msg in [({"config": base.get_config()}, "not a plan written"),
                     ({**saved, "n_layers": 7}, "do not cover")]:
        src.write_text(json.dumps(bad))
        r = run("calibrate", "--reuse", src, "--budget", 3, "--out", out)
        assert r.exit_code == 1 and msg in r.output, r.output
    # widths measured apart combine: 2-bit figures of a kvcx2 run, 3-bit ones of a kvcx3 run (plans of the
    # previous release: rows without "bits", no ladder in the config), on the kvcx2 ladder
    three = {"config": KVConfig.from_scheme("kvcx3").get_config(), "n_layers": 6, "windows": 4, "tokens": 2044,
             "sensitivity": [{"kind": k, "layer": L, "kld": (0.04 if (k, L) == ("key", 3) else 1e-6)}
                             for L in range(6) for k in ("key", "value")]}
    src.write_text(json.dumps(saved))
    src3 = tmp_path / "measured3.json"
    src3.write_text(json.dumps(three))
    r = run("calibrate", "--reuse", src, "--reuse", src3, "--scheme", "kvcx2", "--budget", 3.0, "--out", out,
            "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert {(s["kind"], s["layer"], s["option"]) for s in got["sensitivity"]} == \
        {(k, L, t) for L in range(6) for k in ("key", "value") for t in ("b2", "b3")}
    merged = load_plan(out)
    sel = {L: (kb, vb) for L, kb, vb in merged.layer_bits}
    assert got["extrapolated"] == sum(s not in (2, 3) for L in range(6) for s in sel.get(L, (2, 2)))
    assert merged.for_layer(3).key.bits == 4          # 0.05 at 2 bits and still 0.04 at 3: worth a fourth bit
    assert merged.codec_at("value", 3).scheme == "symmetric"
    three["tokens"] = 1000
    src3.write_text(json.dumps(three))
    r = run("calibrate", "--reuse", src, "--reuse", src3, "--budget", 3.0, "--out", out)
    assert r.exit_code == 1 and "measured on another model or text" in r.output, r.output
    r = run("calibrate", "--scheme", "kvcx2", "--options", "3,8", "--budget", 3.0, "--out", out)
    assert r.exit_code == 1 and "chooses keys from b2,b3,b3g128,b4,b4g128" in r.output, r.output
    r = run("calibrate", "--reuse", tmp_path / "missing.json", "--budget", 3, "--out", out)
    assert r.exit_code == 1 and "no such plan file" in r.output
    # a budget below the scheme's own bits fails before any model is loaded
    r = run("calibrate", "--scheme", "kvcx3", "--budget", 2.0, "--out", out)
    assert r.exit_code == 1 and "at or above the 2.500" in r.output, r.output


def test_calibrate_reuse_of_a_width_plan_changes_the_keys_mean(tmp_path):
    from kvcx.quality.calibrate import reallocate

    saved = read_plan("smollm2-kvcx2w-2.47")
    cfg = load_plan("smollm2-kvcx2w-2.47")
    assert cfg.key.bits == 1.9375 and len(cfg.key_weights) == 30
    res = reallocate(saved, 2.5)
    assert res.config.key.bits == 2.0 and res.config.key_weights == cfg.key_weights
    with pytest.raises(KvcxError, match="budget=1.0"):
        reallocate(saved, 1.0)


def test_the_shipped_kvcx2v_plan_is_the_measured_figures_reallocated():
    """smollm2-kvcx2v-2.12 is `kvcx calibrate --reuse bench/plans/measured/measured-kvcx2v-2.1.json --budget 2.12`:
    the figures `kvcx calibrate --scheme kvcx2v --budget 2.1` measured (each layer's keys alone at 1 to 4 bits per
    code, weighed by the queries) reallocated; each layer's keys a mean width, the values E8P."""
    from pathlib import Path

    from kvcx.codecs.kvconfig import widths_bits
    from kvcx.quality.calibrate import reallocate

    root = Path(__file__).resolve().parents[2]
    measured = json.loads((root / "bench/plans/measured/measured-kvcx2v-2.1.json").read_text())
    again = reallocate(measured, 2.12)
    shipped = load_plan("smollm2-kvcx2v-2.12")
    assert again.config == shipped and read_plan("smollm2-kvcx2v-2.12")["sensitivity"] == measured["sensitivity"]
    widths = [widths_bits(kb) for _, kb, _ in shipped.layer_bits]
    assert len(widths) == 30 and min(widths) == 1 and max(widths) > 2 and shipped.bits_per_value(30) <= 2.12


def test_the_shipped_prerope_plan_is_its_measured_figures_reallocated(tmp_path):
    """smollm2-kvcx2v-prerope-2.12 is `kvcx calibrate --reuse bench/plans/measured/measured-kvcx2v-prerope-2.1.json
    --budget 2.12`: the figures `kvcx calibrate --scheme kvcx2v --keys-before-rope --budget 2.1` measured, each layer's
    keys coded in the frame before the model's RoPE (its frequencies written in the plan, so a packed file of the
    model's cache needs no model); --keys-before-rope with --reuse or a press is refused by name."""
    from pathlib import Path

    from kvcx.codecs import KeyRope
    from kvcx.quality.calibrate import reallocate

    root = Path(__file__).resolve().parents[2]
    measured = json.loads((root / "bench/plans/measured/measured-kvcx2v-prerope-2.1.json").read_text())
    again = reallocate(measured, 2.12)
    shipped = load_plan("smollm2-kvcx2v-prerope-2.12")
    assert again.config == shipped and isinstance(shipped.key_rope, KeyRope)
    assert shipped.key_rope.rotary_dims == 64 and shipped.key_rope.offset == 0
    assert shipped.key_rope.inv_freq[0] == 1.0 and shipped.key_rope.inv_freq[1] == pytest.approx(1e5 ** (-2 / 64))
    assert shipped.bits_per_value(30) <= 2.12 and load_plan("smollm2-kvcx2v-2.12").key_rope is None
    src = root / "bench/plans/measured/measured-kvcx2v-prerope-2.1.json"
    r = run("calibrate", "--reuse", src, "--budget", 2.12, "--keys-before-rope", "--out", tmp_path / "p.json")
    assert r.exit_code == 1 and "--keys-before-rope measures" in r.output and "Traceback" not in r.output, r.output
    r = run("calibrate", "--scheme", "kvcx2v+snapkv:0.5", "--budget", 2, "--keys-before-rope", "--out",
            tmp_path / "p.json")
    assert r.exit_code == 1 and "calibrate the codec alone" in r.output, r.output
    assert not (tmp_path / "p.json").exists()
