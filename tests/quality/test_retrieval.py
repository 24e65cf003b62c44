"""Retrieval with the real embedded model (``kvcx validate --task ruler``): every setting on the exact cache's
prompts, a press that keeps every token answering exactly as the exact cache, eviction and a codec composed, the
bytes counted whole, and the command line's table and JSON."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from kvcx.api import validation_settings  # noqa: E402
from kvcx.cli import app  # noqa: E402
from kvcx.quality import retrieval  # noqa: E402
from kvcx.quality.peers import PEERS  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def results(loaded, wikitext_path):
    configs, _ = validation_settings("kvcx,streaming:1.0,snapkv:1.0,kvcx+snapkv:0.5,knorm:0.25", peers=PEERS)
    return {r.setting: r for r in retrieval.run_retrieval(
        configs, ["niah_single", "passkey"], lengths=[768], depths=[0.2, 0.8], prompts=1, loaded=loaded,
        dataset_file=wikitext_path)}


def test_keeping_every_token_answers_as_the_exact_cache(results):
    for label in ("streaming:1.0", "snapkv:1.0"):
        r = results[label]
        for c in r.cells:
            assert (c.correct, c.only_exact, c.only_setting) == (c.exact_correct, 0, 0), (label, c)
            assert c.p_value == 1.0
        # every token kept at full precision: 16 bits a value, and no positions to store
        assert r.bits_per_value == 16.0
    exact = [(c.task, c.exact_correct) for c in results["kvcx"].cells]
    assert all([(c.task, c.exact_correct) for c in r.cells] == exact for r in results.values())
    assert sum(n for _, n in exact) >= 3        # the model does these tasks at 768 tokens with the exact cache


def test_cells_statistics_and_bytes(results):
    kvcx, composed, knorm = results["kvcx"], results["kvcx+snapkv:0.5"], results["knorm:0.25"]
    assert 4.0 < kvcx.bits_per_value < 4.8
    # half the tokens through the same codec, plus their positions: about half the bits
    assert 0.45 * kvcx.bits_per_value < composed.bits_per_value - 16.0 / 128 / 2 < 0.6 * kvcx.bits_per_value
    assert knorm.bits_per_value == pytest.approx(0.25 * (16.0 + 16.0 / 128), rel=0.02)
    for r in results.values():
        assert [(c.task, c.length) for c in r.cells] == [("niah_single", 768), ("passkey", 768)]
        for c in r.cells:
            assert c.prompts == 2 and c.ci_low <= c.accuracy <= c.ci_high
            assert c.correct - c.exact_correct == c.only_setting - c.only_exact
            assert sum(d["prompts"] for d in c.by_depth) == 2
        kept = [c for c in r.cells if c.kept]
        assert r.passed == (bool(kept) and min(c.p_adjusted for c in kept) >= r.alpha)
        assert r.config.get("press", None) in (None, "streaming", "snapkv", "knorm")


def test_cli_ruler_table_and_json(wikitext_path):
    args = ["validate", "--task", "ruler", "--tasks", "niah_single", "--lengths", "512", "--depths", "0.5",
            "--prompts", "1", "--scheme", "kvcx,streaming:0.5+kvcx3", "--cpu", "--dataset-file", str(wikitext_path)]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code in (0, 3), r.output
    rows = json.loads(r.stdout)
    assert [x["setting"] for x in rows] == ["kvcx", "streaming:0.5+kvcx3"]
    assert rows[1]["config"]["press"] == "streaming" and rows[1]["config"]["scheme"] == "kvcx3"
    assert rows[1]["bits_per_value"] < rows[0]["bits_per_value"]
    for x in rows:
        assert {"bits_per_value", "passed", "p_value", "alpha", "dropped", "tasks"} <= set(x)
        (cell,) = x["cells"]
        assert {"task", "length", "accuracy", "correct", "prompts", "ci_low", "ci_high"} <= set(cell)
    assert r.exit_code == (0 if all(x["passed"] for x in rows) else 3)
    r = CliRunner().invoke(app, args)
    assert "exact cache" in r.output and "niah_single" in r.output and "95 % Wilson interval" in r.output
