"""The retrieval guard's rule (kvcx.quality.guard) on bench.bench_retrieval_loss's figures: which layers' keys get
8 bits; the shipped plan smollm2-kvcx-4.58 is what the rule writes from the recorded 8k measurement."""
import json
from pathlib import Path

import numpy as np

from bench.bench_retrieval_loss import guard_plan, layer_losses
from kvcx.api import load_plan, read_plan

ROOT = Path(__file__).resolve().parents[1]


def _forced(losses, whole):
    """log p rows as the bench records them: exact at 0, each layer's keys alone coded losing ``losses[i]``."""
    rows = {"exact": [0.0, 0.0], "kvcx": [-whole, -whole], "keys exact": [0.0, 0.0], "values exact": [-whole] * 2}
    for i, x in enumerate(losses):
        rows[f"layer {i} exact"] = [-whole + x] * 2
        rows[f"layer {i} only coded"] = [-x, -x]
    return rows


def test_the_bench_reads_each_layers_loss_and_the_whole():
    losses, whole = layer_losses(_forced([0.001, 0.05, 0.0, 0.02, -0.01], whole=0.1))
    assert np.allclose(losses, [0.001, 0.05, 0.0, 0.02, -0.01]) and np.isclose(whole, 0.1)


def test_the_plan_gives_the_guarded_layers_8_bit_keys(tmp_path):
    out = tmp_path / "plan.json"
    assert guard_plan("kvcx", _forced([0.0, 0.05, 0.0], whole=0.1), 0.15, out, "m") == [1]
    cfg = load_plan(out)
    assert [(L, vb) for L, _, vb in cfg.layer_bits] == [(1, 4)] and cfg.scheme == "kvcx"
    assert cfg.for_layer(1).key.bits == 8 and cfg.for_layer(0).key.bits == 4
    assert read_plan(out)["bits_per_value"] == cfg.bits_per_value(3) and read_plan(out)["model"] == "m"


def test_the_shipped_plan_is_the_rule_applied_to_the_recorded_measurement(tmp_path):
    saved = json.loads((ROOT / "docs/results/retrieval-loss-8k.json").read_text())
    out = tmp_path / "plan.json"
    layers = guard_plan(saved["args"]["scheme"], saved["forced"], 0.15, out, "m")
    assert layers == [17, 18, 20]
    # the shipped plan was written (and measured) with 8-bit integer keys; the rule now writes 8-bit keys of a width
    # per channel (KVConfig.guarded: the codes the fused kernel reads): the same layers, keys and values
    written, shipped = load_plan(out), load_plan("smollm2-kvcx-4.58")
    assert [L for L, _, _ in written.layer_bits] == [L for L, _, _ in shipped.layer_bits] == layers
    assert all(written.for_layer(L).key.bits == shipped.for_layer(L).key.bits == 8 for L in layers)
    assert all(written.for_layer(L).value == shipped.for_layer(L).value for L in range(30))
    assert all(written.for_layer(L) == shipped.for_layer(L) for L in range(30) if L not in layers)
    exact = np.array(saved["forced"]["exact"])
    whole = (exact - np.array(saved["forced"]["kvcx"])).mean()
    assert whole > 0   # the measured loss the guard answers


def test_kvcx2vs_measured_guard_is_the_rule_applied_to_its_recorded_measurement(tmp_path):
    """bench/plans/measured/kvcx2v-guard-8192.json (docs/results/retrieval-passkey-8k-90-kvcx2v-measured-guard.md) is
    what --write-plan gives from kvcx2v's 8k needle figures as recorded on 2026-11-30 (the older widths keys and E8P
    values, kept under docs/results/history/): 8-bit widths keys in 7 layers, E8P values. The current codec's figures
    (docs/results/retrieval-loss-8k-kvcx2v.json, 2026-12-04) show no loss over the 25 prompts, and the rule guards
    no layer."""
    from kvcx.codecs.kvconfig import KVConfig

    saved = json.loads((ROOT / "docs/results/history/retrieval-loss-8k-kvcx2v-2026-11-30.json").read_text())
    out = tmp_path / "plan.json"
    layers = guard_plan(saved["args"]["scheme"], saved["forced"], 0.15, out, "m")
    assert layers == [2, 7, 15, 18, 20, 21, 23]
    shipped = load_plan(ROOT / "bench/plans/measured/kvcx2v-guard-8192.json")
    assert load_plan(out) == shipped == KVConfig.from_scheme("kvcx2v").guarded(layers)
    now = json.loads((ROOT / "docs/results/retrieval-loss-8k-kvcx2v.json").read_text())
    whole = (np.array(now["forced"]["exact"]) - np.array(now["forced"]["kvcx2v"])).mean()
    assert whole <= 0
    assert guard_plan(now["args"]["scheme"], now["forced"], 0.15, tmp_path / "now.json", "m") == []
