"""Calibration with tokens as a second axis: one budget, counted whole, spent on keep ratios and codecs per layer
(no model: measured figures given; the allocation is checked against exhaustive search)."""
import itertools
import json
import math

import pytest

from kvcx.api import load_plan
from kvcx.codecs import KVConfig
from kvcx.codecs.plan_record import check_plan_record
from kvcx.presses import Press, PressedSetting
from kvcx.errors import KvcxError
from kvcx.quality.calibrate import (Calibration, _costs, allocate_pressed, keep_ladder, keep_tag, plan_options,
                                    reallocate)

HEAD_DIM = 64


def _figures(n_layers, seed=0):
    """Sensitivities with structure: fewer bits and fewer tokens cost more, some layers far more than others."""
    import random

    rnd = random.Random(seed)
    base = KVConfig.from_scheme("kvcx3")
    cost = _costs(base)
    sens = {}
    for L in range(n_layers):
        w = rnd.choice([0.1, 1.0, 10.0])
        for kind in ("key", "value"):
            for t in plan_options(base, kind):
                sens[(kind, L, t)] = w * 0.01 * 4.0 ** (4.5 - cost[(kind, t)]) * rnd.uniform(0.8, 1.2)
        for r in keep_ladder(Press("snapkv", 0.5)):
            sens[("keep", L, keep_tag(r))] = w * 0.05 * (1 - r) * rnd.uniform(0.5, 1.5)
    return base, sens


def _whole(base, r, tk, tv):
    cost = _costs(base)
    return r * (cost[("key", tk)] + cost[("value", tv)]) / 2 + (16 * r / (2 * HEAD_DIM) if r < 1 else 0.0)


@pytest.mark.parametrize("budget", [2.0, 1.0, 0.5])
def test_allocation_is_the_exact_optimum_within_the_budget(budget):
    n = 2
    base, sens = _figures(n, seed=int(budget * 10))
    press = Press("snapkv", 0.5)
    plan, pressed, est, guessed, bpv = allocate_pressed(sens, base, press, n, HEAD_DIM, budget)
    assert bpv <= budget + 1e-9 and guessed == 0
    assert len(pressed.layer_keep) == n and pressed.keep == pytest.approx(sum(pressed.layer_keep) / n)
    # exhaustive: every layer's (keep, key codec, value codec), the least summed KLD within the budget
    keeps = [1.0] + keep_ladder(press)
    per_layer = [[(r, tk, tv) for r in keeps for tk in plan_options(base, "key") for tv in plan_options(base, "value")]
                 for _ in range(n)]
    best = math.inf
    for combo in itertools.product(*per_layer):
        units = sum(math.ceil(_whole(base, *c) * 64 - 1e-6) for c in combo)
        if units <= budget * n * 64 + 1e-6:
            best = min(best, sum((0 if r == 1 else sens[("keep", L, keep_tag(r))]) + sens[("key", L, tk)] +
                                 sens[("value", L, tv)] for L, (r, tk, tv) in enumerate(combo)))
    assert est == pytest.approx(best, rel=1e-9)


def test_a_tighter_budget_keeps_fewer_tokens_and_bits():
    base, sens = _figures(12)
    press = Press("snapkv", 0.5)
    got = {b: allocate_pressed(sens, base, press, 12, HEAD_DIM, b) for b in (2.0, 1.0, 0.5)}
    assert got[2.0][2] < got[1.0][2] < got[0.5][2]                     # estimated KLD grows as the budget shrinks
    assert got[2.0][1].keep > got[1.0][1].keep > got[0.5][1].keep
    with pytest.raises(KvcxError, match=r"budget=0.1 bits/value must be at least 0.328"):
        allocate_pressed(sens, base, press, 12, HEAD_DIM, 0.1)


def test_a_plan_with_a_press_round_trips_through_its_file_and_reallocates(tmp_path):
    base, sens = _figures(6)
    press = Press("knorm", 0.5)
    plan, pressed, est, guessed, bpv = allocate_pressed(sens, base, press, 6, HEAD_DIM, 1.0)
    cal = Calibration(config=plan, sensitivity=sens, budget=1.0, bits_per_value=bpv, n_layers=6, windows=1,
                      tokens=511, model="m", estimated_kld=est, press=pressed, head_dim=HEAD_DIM)
    record = json.loads(json.dumps(cal.to_dict()))
    check_plan_record(record, "plan.json")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(record))
    setting = load_plan(path)
    assert isinstance(setting, PressedSetting) and setting.press == pressed and setting.codec == plan
    again = reallocate(record, 1.0)
    assert again.press == pressed and again.config == plan and again.estimated_kld == pytest.approx(est)
    smaller = reallocate(record, 0.5)
    assert smaller.bits_per_value <= 0.5 and smaller.press.keep < pressed.keep
    record["press"]["layer_keep"] = [0.5, 2.0]
    path.write_text(json.dumps(record))
    with pytest.raises(KvcxError, match="the keep ratio must be in"):
        load_plan(path)
    record["sensitivity"].append({"kind": "keep", "layer": 0, "option": "kx", "kld": 0.1})
    with pytest.raises(KvcxError, match="k0.5 for an eviction"):
        check_plan_record(record, "plan.json")


def test_calibrate_refuses_what_no_plan_can_meet_before_the_model_loads(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kvcx.cli import app

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the options were checked")
    monkeypatch.setattr("kvcx.quality.models.load_model_and_tokenizer", no_model)
    for args, match in ((["--scheme", "kvcx3+snapkv:0.5", "--budget", "0.2"], "must be above 0.312"),
                        (["--scheme", "snapkv:0.5", "--budget", "1"], "compose the press with a scheme"),
                        (["--scheme", "kvcx3+snapkv:0", "--budget", "1"], "keep ratio must be in (0, 1]"),
                        (["--scheme", "kvcx3+snapkv:0.5", "--budget", "1", "--options", "b2"], "leave --options out")):
        r = CliRunner().invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), *args])
        assert r.exit_code == 1 and match in r.output and "Traceback" not in r.output, (args, r.output)
