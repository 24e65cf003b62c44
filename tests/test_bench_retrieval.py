"""bench.bench_retrieval, the one retrieval bench, runs each of its layouts on the embedded model at a tiny size:
the retrieval table, the per-depth table, and with --ppl-windows / --pareto the both-axes table (a row a setting,
its kind, perplexity and KLD beside retrieval) and its chart. Its figures here say nothing of quality."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.model


def test_one_bench_writes_the_retrieval_and_both_axes_tables(tmp_path, wikitext_path, loaded):
    from bench import bench_retrieval as bench

    md, js, png = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.png"
    bench.main(["--tasks", "passkey", "--lengths", "512", "--depths", "0.2,0.8", "--prompts", "1",
                "--scheme", "kvcx,snapkv:0.5,kvcx+snapkv:0.5", "--ppl-windows", "1", "--stride", "256",
                "--dataset-file", str(wikitext_path), "--markdown", str(md), "--json", str(js), "--pareto", str(png)])
    text = md.read_text()
    assert text.startswith("<!-- written by `python ") and "query-agnostic" in text
    head = next(line for line in text.splitlines() if line.startswith("| task | context | exact cache |"))
    assert "`kvcx` (" in head and "`kvcx+snapkv:0.5` (" in head
    depth_rows = [line for line in text.splitlines() if line.startswith("| passkey | 512 | ")]
    assert len(depth_rows) == 1 + 2   # the cell, then its two depths
    rows = {line.split(" | ")[0][2:].strip("`"): line.split(" | ") for line in text.splitlines()
            if line.startswith(("| `", "| exact cache | exact"))}
    assert [rows[s][1] for s in ("kvcx", "snapkv:0.5", "kvcx+snapkv:0.5")] == ["quantization", "eviction", "both"]
    assert rows["exact cache"][1] == "exact"
    for s in ("kvcx", "snapkv:0.5", "kvcx+snapkv:0.5"):   # ppl delta and KLD at 512
        assert abs(float(rows[s][-2])) < 100 and float(rows[s][-1].rstrip(" |")) >= 0
    assert "; perplexity " in text and "![accuracy against bits per value-equivalent](r.png)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert [r["setting"] for r in data["retrieval"]] == ["kvcx", "snapkv:0.5", "kvcx+snapkv:0.5"]
    assert set(data["perplexity"]["512"]) == {"kvcx", "snapkv:0.5", "kvcx+snapkv:0.5"}
