"""bench/bench_query_weights.py at a small scale: the page compares kvcx2w's keys over the query weights read where
the attention reads the queries against the weights read from q_proj's outputs; a Llama (no query norm) gets the same
weights and the same keys both ways, Qwen 3.5 (per-head q_norm and an output gate in q_proj) weights that differ;
bad arguments are one line."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import bench_query_weights  # noqa: E402


def test_the_page_compares_the_two_readings(tmp_path, wikitext_path):
    page = tmp_path / "query-weights.md"
    bench_query_weights.main(["--window", "128", "--cal-windows", "1", "--eval-windows", "2", "--families", "Llama",
                              "Qwen 3.5 (linear)", "--text", str(wikitext_path), "--markdown", str(page)])
    text = page.read_text()
    assert text.startswith("<!-- written by `python ") and "# Query weights" in text
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| Llama") or line.startswith("| Qwen 3.5")}
    llama, qwen = rows["Llama"], rows["Qwen 3.5 (linear)"]
    assert llama[1] == "none" and float(llama[2]) == pytest.approx(1.0, abs=1e-3)
    assert llama[3] == llama[4] and llama[5] == "1.00"      # the same weights: the same keys, the same KLD
    assert qwen[1] == "per head + output gate" and float(qwen[2]) < 0.5
    assert "Where the two readings differ (1 of 2 families)" in text


def test_bad_arguments_are_one_line(capsys):
    for argv in (["--families", "Nope"], ["--window", "30"], ["--families", "DeepSeek V3 (MLA)"]):
        with pytest.raises(SystemExit) as exc:
            bench_query_weights.main(argv)
        assert exc.value.code == 2
    assert "families of Llama" in capsys.readouterr().err
