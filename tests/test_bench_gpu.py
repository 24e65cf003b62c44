"""bench/bench_gpu.py runs every section (--smoke: tiny shapes; Triton's interpreter where there is no GPU), so
that the GPU session that measures it does not find a broken script. Its figures here say nothing about speed."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_gpu.py"


def test_every_section_runs_and_writes_its_table(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gpu.md"
    bench.main(["--smoke", "--markdown", str(out)])
    text = out.read_text()
    assert text.startswith("<!-- written by `python ") and "Device: " in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 + 1   # attention: 2 contexts x 2 batches; generate: 1 prompt
    assert sum(line.startswith("| kvcx ") for line in text.splitlines()) == 2   # bandwidth: keys, values
    gen = rows[-1].split(" | ")
    assert gen[-2] == "triton" and int(gen[-1].rstrip(" |")) > 0   # generate() ran the fused Triton steps
    assert "## 4. Memory: the packed store holds" in text
