"""Plans and calibration files are read as strictly as packed files (hardening, second round): every field
typed and bounded, budgets bounded; a bad file is one red line, never a traceback, a hang or a memory blow-up."""
import json
import time

import pytest

from helpers import run
from kvcx.api import load_plan, read_plan
from kvcx.errors import FormatError, KvcxError
from kvcx.quality.calibrate import reallocate


def _variants():
    base = read_plan("smollm2-kvcx2-3.50")
    widths = read_plan("smollm2-kvcx2w-2.47")
    yield "key_weights null", {**widths, "config": {**widths["config"], "key_weights": None}}, "key_weights"
    yield "a 401-digit weight", {**widths, "config": {**widths["config"], "key_weights": {"0": [[10 ** 400] * 64] * 3}}}, \
        "key_weights"
    yield "n_layers 1e999", {**base, "n_layers": float("inf")}, "n_layers"
    yield "n_layers as a string", {**base, "n_layers": "30"}, "n_layers"
    yield "a 401-digit budget", {**base, "budget": 10 ** 400}, "budget"
    yield "kld as a string", {**base, "sensitivity": [{"kind": "key", "layer": 0, "option": "b2", "kld": "x"}]}, \
        "sensitivity figure"
    yield "a layer past n_layers", {**base, "sensitivity": [{"kind": "key", "layer": 99, "option": "b2", "kld": 0.1}]}, \
        "sensitivity figure"
    yield "tokens negative", {**base, "tokens": -1}, "tokens"
    yield "config null", {**base, "config": None}, "'config' must be an object"
    yield "an unknown field", {**base, "extra": 1}, "unknown fields"
    yield "layer_bits as a number", {**base, "config": {**base["config"], "layer_bits": 7}}, "layer_bits"
    yield "a planned layer twice", {**base, "layers": [{"layer": 1, "type": "sliding_attention"}] * 2}, "'layers'"
    yield "a planned layer past n_layers", {**base, "layers": [{"layer": 30, "type": "full_attention"}]}, "'layers'"
    yield "a layer type not a name", {**base, "layers": [{"layer": 0, "type": 3}]}, "'layers'"


@pytest.mark.parametrize("what,plan,message", list(_variants()), ids=[v[0] for v in _variants()])
def test_bad_plan_files_are_one_red_line(tmp_path, small_cache_file, what, plan, message):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    for args in (["compress", small_cache_file, tmp_path / "o.safetensors", "--plan", p],
                 ["calibrate", "--reuse", p, "--budget", "3", "--out", tmp_path / "n.json"]):
        r = run(*args)
        assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, (what, args, r.output)
    with pytest.raises((FormatError, KvcxError), match=message):
        load_plan(p)


def test_budgets_are_bounded(tmp_path):
    saved = read_plan("smollm2-kvcx2-3.50")
    t = time.perf_counter()
    plan = reallocate(saved, 1e30)   # more than the costliest plan buys nothing more: no knapsack of 1e30 units
    assert time.perf_counter() - t < 10 and plan.bits_per_value <= 4.5 + 1e-9
    for budget in ("nan", "inf", "-1"):
        r = run("calibrate", "--reuse", "smollm2-kvcx2-3.50", "--budget", budget, "--out", tmp_path / "n.json")
        assert r.exit_code == 1 and "--budget" in r.output and "Traceback" not in r.output, r.output
    r = run("calibrate", "--reuse", "smollm2-kvcx2w-2.47", "--budget", "1e30", "--out", tmp_path / "n.json")
    assert r.exit_code == 1 and "--budget 1e+30: the keys would get" in r.output, r.output
