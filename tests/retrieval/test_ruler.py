"""The retrieval tasks' prompts, built with a byte tokenizer (no model): their length, where the needles sit,
what counts as answered, the same prompts for the same seed; and the options checked before a model loads."""
import dataclasses
import json

import pytest
from typer.testing import CliRunner

from kvcx.cli import app
from kvcx.errors import KvcxError
from kvcx.quality import retrieval, ruler

TEXT = ("The history of the valley begins with the river . " * 40 + "Farmers settled on its banks . " * 40) * 20


def encode(text):
    return list(text.encode())


def decode(ids):
    return bytes(ids).decode(errors="replace")


HAY = ruler.haystack_from(encode, TEXT)


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_every_task_fits_its_length_and_holds_its_answers(task):
    for length in (1500, 3000):
        p = ruler.TASKS[task].build(encode, HAY, length, 0.5, ruler.rng_for(0, task, length, 2, 0))
        total = len(p.context) + len(p.question) + p.answer_tokens
        assert length - 100 < total <= length, (task, length, total)
        text = decode(p.context)
        assert all(a in text or a in decode(p.question) for a in p.answers)
        assert p.answered(" " + ", ".join(p.answers) + ".") and not p.answered("")
        assert p.settled(" " + ", ".join(p.answers) + ".") and not p.settled(" " + ", ".join(p.answers))


def test_prompts_are_seeded_and_differ_by_prompt_and_seed():
    def build(seed, prompt):
        return ruler.TASKS["niah_multikey"].build(encode, HAY, 1000, 0.3, ruler.rng_for(seed, "niah_multikey", 1000,
                                                                                       1, prompt))
    a, b, c = build(0, 0), build(0, 0), build(0, 1)
    assert a.context == b.context and a.answers == b.answers
    assert a.answers != c.answers and build(1, 0).answers != a.answers


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_the_queried_needle_sits_at_its_depth(depth):
    p = ruler.TASKS["niah_single"].build(encode, HAY, 2000, depth, ruler.rng_for(0, "niah_single", 2000, 0, 0))
    text = decode(p.context)
    at = text.index(p.answers[0]) / len(text)
    assert abs(at - depth) < 0.08, (depth, at)


def test_needles_distractors_values_and_queries():
    rng = lambda t: ruler.rng_for(3, t, 1500, 0, 0)   # noqa: E731
    multikey = ruler.TASKS["niah_multikey"].build(encode, HAY, 1500, 0.5, rng("niah_multikey"))
    assert len(multikey.answers) == 1 and decode(multikey.context).count("One of the special magic numbers") == 4
    multivalue = ruler.TASKS["niah_multivalue"].build(encode, HAY, 1500, 0.5, rng("niah_multivalue"))
    assert len(multivalue.answers) == 4 and len(set(multivalue.answers)) == 4
    multiquery = ruler.TASKS["niah_multiquery"].build(encode, HAY, 1500, 0.5, rng("niah_multiquery"))
    assert len(multiquery.answers) == 4 and decode(multiquery.question).count(" and ") == 2   # named twice
    vt = ruler.TASKS["vt"].build(encode, HAY, 1500, 0.2, rng("vt"))
    text = decode(vt.context)
    assert len(vt.answers) == 5 and all(f"VAR {v} =" in text for v in vt.answers)
    assert text.index(f"VAR {vt.answers[0]} =") < text.index(f"VAR {vt.answers[-1]} =")
    cwe = ruler.TASKS["cwe"].build(encode, HAY, 1500, 0.5, rng("cwe"))
    words = [x.split(". ")[1] for x in decode(cwe.context).split("\n", 1)[1].split(" ") if ". " in x] or \
        decode(cwe.context).split("\n", 1)[1].split()[1::2]
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert sorted(top) == sorted(cwe.answers) and min(counts[w] for w in top) > max(
        (c for w, c in counts.items() if w not in top), default=0)
    assert len(cwe.answers) == 10 and not ruler.TASKS["cwe"].uses_depth
    assert [t for t in ruler.TASKS if ruler.TASKS[t].uses_haystack] == [t for t in ruler.TASKS if t.startswith("niah")]


def test_whole_word_matching():
    p = ruler.Prompt([], [], ["12345"], 8)
    assert p.answered("it is 12345.") and not p.answered("it is 123456") and not p.answered("012345")
    assert not p.settled("it is 12345") and p.settled("it is 12345,")


def test_task_names():
    assert ruler.task_names("ruler") == [t for t in ruler.TASKS if t != "passkey"]
    assert ruler.task_names("vt, niah_single") == ["vt", "niah_single"]
    with pytest.raises(KvcxError, match="'niah' is not a task; the tasks are"):
        ruler.task_names("niah")
    with pytest.raises(KvcxError, match="name each task once"):
        ruler.task_names("vt,vt")


def test_too_short_for_the_prompt():
    for task in ruler.TASKS:
        with pytest.raises(KvcxError, match="no room for the .* prompt; use longer lengths"):
            ruler.TASKS[task].build(encode, HAY, 300, 0.5, ruler.rng_for(0, "x", 300, 0, 0))


@pytest.mark.parametrize("args,match", [
    (["--task", "ruler", "--tasks", "niah"], "'niah' is not a task"),
    (["--task", "ruler", "--lengths", "1024,99999"], "99999 exceeds the model's context of 8192"),
    (["--task", "ruler", "--lengths", "100"], "100 is shorter than 256 tokens"),
    (["--task", "ruler", "--lengths", "4k"], "--lengths '4k' must be token counts"),
    (["--task", "ruler", "--depths", "1.5"], "fractions of the context"),
    (["--task", "ruler", "--prompts", "0"], "--prompts 0 must be at least 1"),
    (["--task", "ruler", "--scheme", "kvcx+snapkv:0"], "keep ratio must be in (0, 1]"),
    (["--task", "ruler", "--scheme", "kvcx+snap:0.5"], "press 'snap' does not exist"),
    (["--task", "ruler", "--alpha", "2"], "--alpha 2.0 must be a significance level"),
    (["--task", "ruler", "--mode", "generation"], "runs in prefix mode"),
    (["--task", "passkey", "--tolerance", "1"], "--tolerance was replaced by a paired test"),
    (["--tasks", "vt"], "add --task ruler"),
    (["--scheme", "kvcx+snapkv:0.5", "--mode", "engine"], "use --mode prefix or --mode generation"),
    (["--scheme", "kvcx+snapkv:0.5", "--quick-test"], "--quick-test has no model"),
    (["--keys-before-rope", "--quick-test"], "--quick-test has no model"),
    (["--scheme", "kvcx2v", "--keys-before-rope", "--mode", "generation"], "validate it with --mode prefix or --mode engine"),
    (["--task", "bleu"], "must be perplexity, ruler or passkey"),
    (["--task", "ruler", "--tasks", "niah_single", "--dataset-file", "/nonexistent/wiki.test.raw"],
     "dataset file not found")])
def test_bad_options_fail_before_the_model_loads(args, match, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model loaded before the options were checked")
    monkeypatch.setattr("kvcx.quality.models.load_model_and_tokenizer", no_model)
    r = CliRunner().invoke(app, ["validate", *args])
    assert r.exit_code == 1 and match in r.output and "Traceback" not in r.output, r.output


def test_result_json_shape():
    cell = retrieval._cell("niah_single", 1024, [(0.5, True)] * 18 + [(0.5, False)] * 2,
                           [(0.5, True)] * 12 + [(0.5, False)] * 8, True)
    assert (cell.correct, cell.exact_correct, cell.only_exact, cell.only_setting) == (12, 18, 6, 0)
    assert cell.p_value == pytest.approx(1 / 64) and cell.ci_low < 0.6 < cell.ci_high
    r = retrieval.RetrievalResult("kvcx", "ruler", ["niah_single"], {}, [1024], [0.5], 20, [cell])
    d = json.loads(json.dumps(r.to_dict()))
    assert set(d["cells"][0]) >= {"task", "length", "accuracy", "correct", "prompts", "ci_low", "ci_high"}
    assert {"bits_per_value", "passed", "p_value", "alpha"} <= set(d)


def test_a_failing_codec_is_pointed_at_the_retrieval_guard_and_a_failing_press_is_not(capsys):
    """The red verdict of a codec (not a press) names the guard that fixes the usual cause (a few layers' keys)."""
    from kvcx.cli import render

    cell = retrieval._cell("passkey", 8192, [(0.9, True)] * 25, [(0.9, True)] * 19 + [(0.9, False)] * 6, True)
    cell = dataclasses.replace(cell, p_adjusted=cell.p_value)

    def result(setting, config):
        return retrieval.RetrievalResult(setting, "passkey", ["passkey"], {}, [8192], [0.9], 25, [cell],
                                         p_value=cell.p_value, passed=False, config=config)

    render.print_retrieval([result("kvcx", {"scheme": "kvcx"})], ["kvcx"], quiet=True)
    text = " ".join(capsys.readouterr().out.split())
    assert "FAILED: kvcx" in text and "--guard-retrieval 8192" in text
    render.print_retrieval([result("snapkv:0.5", {"scheme": "exact", "press": "snapkv", "keep": 0.5})],
                           ["snapkv:0.5"], quiet=True)
    text = capsys.readouterr().out
    assert "FAILED: snapkv:0.5" in text and "guard-retrieval" not in text
