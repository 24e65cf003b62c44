"""bench/bench_mla.py writes its table (a run at a small scale): each cache's row at each context, each row's
ratio its step against DynamicCache's in the same run, the packed latent's bytes; and
bench.publish reads the page's longest context into the README's headline row."""
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import bench_mla, publish  # noqa: E402


def test_the_mla_bench_writes_its_table_and_the_headline_reads_it(tmp_path, monkeypatch):
    page = tmp_path / "mla.md"
    bench_mla.main(["--contexts", "256", "512", "--heads", "2", "--steps", "2", "--threads", "1",
                    "--markdown", str(page)])
    text = page.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| [\d,]+ \|", line)]
    assert [(r[0].strip(), r[1].strip().split(" ")[0]) for r in rows] == [
        (n, c) for n in ("256", "512") for c in ("DynamicCache", "KvcxCache", "KvcxCache")]
    for i in (0, 3):   # the ratio column is DynamicCache's step over the row's, in the same run
        base = float(rows[i][2])
        for r in rows[i:i + 3]:
            assert float(r[3].strip().rstrip("x")) == pytest.approx(base / float(r[2]), rel=0.02, abs=0.011)
        assert float(rows[i + 1][6].strip().rstrip("x")) < 0.5   # packed latent: under half DynamicCache's bytes
    monkeypatch.setattr(publish, "RESULTS", tmp_path)
    row = publish.mla()
    assert "after 512 tokens" in row and f"{rows[5][2].strip()} vs {rows[3][2].strip()} ms" in row


@pytest.mark.parametrize("args", [["--contexts", "64"], ["--threads", "0"], ["--heads", "0"], ["--steps", "-1"]])
def test_bad_arguments_are_one_line(args, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_mla.main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and "1 thread or more" in err
