"""bench.bench_gpu runs every section (--smoke: tiny shapes; Triton's interpreter where there is no GPU), so
that the GPU session that measures it does not find a broken script. Its figures here say nothing about speed."""
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def test_every_section_runs_and_writes_its_table(tmp_path):
    from bench import bench_gpu as bench

    out = tmp_path / "gpu.md"
    bench.main(["--smoke", "--markdown", str(out)])
    text = out.read_text()
    assert text.startswith("<!-- written by `python ") and "Device: " in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 + 2   # attention: 2 contexts x 2 batches; generate: 1 prompt x 2 batches
    assert sum(line.startswith("| kvcx ") for line in text.splitlines()) == 2   # bandwidth: keys, values
    assert sum(line.startswith("| kvcx2v values (E8P") for line in text.splitlines()) == 1   # and E8P's
    assert sum(line.startswith("| kvcx2v keys (widths") for line in text.splitlines()) == 1   # and the widths codec's
    gen = rows[-1].split(" | ")
    assert gen[-2] == "triton" and int(gen[-1].rstrip(" |")) > 0   # generate() ran the fused Triton steps
    assert "## 4. Memory: the packed store holds" in text
    assert "paged in order / contiguous |" in text and all(line.count(" | ") == 17 for line in rows[:4])


def test_the_tune_passes_each_setting_it_times_and_runs_the_sections_with_its_choice(tmp_path, monkeypatch):
    """--tune (section 5) times launch settings by passing each LaunchSettings to the step (nothing in the package
    is set): each row names its setting; the choice, one of them within the error bar, is what the attention
    section then states it ran with; the package's defaults are unchanged after the run."""
    from bench import bench_gpu as bench

    from kvcx.codecs import gpu_attn

    tried = [gpu_attn.LaunchSettings(dot="", warps=4), gpu_attn.LaunchSettings(),
             gpu_attn.LaunchSettings(merge_warps=8, merge_splits=2)]
    monkeypatch.setattr(bench, "SETTINGS", tried)
    out = tmp_path / "tune.md"
    bench.main(["--smoke", "--tune", "--skip", "bandwidth", "generate", "--markdown", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`LaunchSettings(" in line]
    assert [r.split(" | ")[2].strip("`") for r in rows] == [str(s) for s in tried]
    assert all(r.split(" | ")[-1].strip(" |") != "" and "failed" not in r for r in rows)
    chosen = next(s for s in tried if f"the FP32 sums'): `{s}`" in text)
    assert f"launch settings: {bench.describe(chosen)}" in text
    assert gpu_attn.DEFAULT_LAUNCH == gpu_attn.LaunchSettings()


def test_the_step_profile_runs_and_names_the_kernels(tmp_path):
    """bench/profile_gpu.py (--smoke: tiny shapes, the interpreter) gives a step's calls by time with a launch
    setting from the command line, and refuses a name that is not one."""
    from bench import profile_gpu

    out = tmp_path / "profile.md"
    from kvcx.codecs import gpu, gpu_attn

    profile_gpu.main(["--smoke", "--set", "split_tokens=128", "merge_warps=8", "CODEC_WARPS=2", "--codecs",
                      "--markdown", str(out)])
    assert gpu.CODEC_WARPS == 4 and gpu_attn.DEFAULT_LAUNCH == gpu_attn.LaunchSettings()   # held for the run only
    text = out.read_text()
    assert "`LaunchSettings(split_tokens=128, merge_warps=8)`" in text and "at least 128 tokens a split" in text
    assert "| launches a step |" in text
    step, _, calls = text.partition("### The codec calls")
    rows = [line for line in step.splitlines() if line.startswith("| `")]
    assert rows and all(float(line.split(" | ")[2]) >= 0 for line in rows)
    # the codec calls: a row per codec and launch setting (the smoke run's first two and last of each), the kernels
    # of each call, the host's functions of each
    settings = [line for line in calls.splitlines() if line.startswith("| kvcx ")]
    assert len(settings) == 6 and all(float(line.split(" | ")[4]) > 0 for line in settings)
    assert calls.count("the kernels of a call") == 4 and calls.count("cProfile over") == 4
    host = [line.split(" | ") for line in calls.splitlines() if line.startswith("| `") and line.count(" | ") == 3]
    assert len(host) >= 4 and all(float(r[2]) >= 0 and float(r[3].rstrip(" |")) >= float(r[2]) for r in host)
    for bad in ("NOT_A_SETTING=1", "split_tokens=0", "split_tokens=x", "dot='int4'", "CODEC_WARPS=3",
                "merge_pdl=3", "early_tile='yes'", "ATTN_SPLIT_TOKENS=128"):
        with pytest.raises(SystemExit):
            profile_gpu.main(["--smoke", "--set", bad])


def sass_near() -> int:
    from bench.sass_gpu import NEAR

    return NEAR


def test_the_offline_instruction_count_finds_the_kernels_loop(tmp_path):
    """bench/sass_gpu.py compiles the attention kernel for sm_90 (no GPU), disassembles it and counts its main
    loop: the FP32-sums setting has no tensor-core products in it, the default's FP16 products are there; what the
    loop waits on. It counts the merge kernel (after the dependent launch's wait: a part of it) and the codec
    kernels too."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    out = tmp_path / "sass.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "bench.sass_gpu", "--limit", "2", "--markdown", str(out)],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = out.read_text().splitlines()
    head = next(line for line in lines if line.startswith("| setting |")).strip("| ").split(" | ")
    rows = [dict(zip(head, line.strip("| ").split(" | "))) for line in lines
            if line.startswith(("| 32 tokens", "| 64 tokens"))]
    assert len(rows) == 2
    sums, default = rows      # the FP32 sums (the error reference), the default (products on the tensor cores)
    assert "FP32 sums" in sums["setting"] and float(sums["MMA"]) == 0
    assert "fp16" in default["setting"] and float(default["MMA"]) > 0 and float(default["half"]) > 0
    # the fast mode's loop: far fewer instructions a token than FP32 sums (the codes become FP16 in PTX: the
    # byte permute, lop3 and FP16x2 arithmetic, 10 instructions for 8 codes)
    assert float(default["warp instructions / token"]) < float(sums["warp instructions / token"]) / 3
    assert int(default["registers"]) > 0 and int(default["warps a multiprocessor"]) > 0
    for r in rows:
        per_token = float(r["loop instructions / token"])
        assert 0 < per_token * int(r["tile tokens"]) < int(r["kernel instructions"])
        assert float(r["warp instructions / token"]) >= per_token
    for r in rows:   # what a program's own loop waits on: counts, not times
        assert int(r[f"loads awaited within {sass_near()} instructions a tile"]) >= 0
        assert r["load groups in flight at the wait"] == "n/a" or int(r["load groups in flight at the wait"]) >= 0
    # the merge kernel as a batch-1 step launches it, with and without the dependent launch (the first two settings)
    head = next(line for line in lines if line.startswith("| merge warps |")).strip("| ").split(" | ")
    merges = [line.strip("| ").split(" | ") for line in lines if line.startswith("| 4 | 64 |")]
    assert {m[head.index("dependent launch")] for m in merges} == {"yes", "no"}
    for m in merges:
        assert int(m[head.index("barriers")]) > 0 and int(m[head.index("in the loop")]) > 0
        if m[head.index("dependent launch")] == "yes":   # the columns after the wait: a part of the whole
            assert 0 < int(m[head.index("after the wait")]) < int(m[head.index("instructions")])
    # the codec kernels as bench_gpu.py launches them: each encode and decode counted, and the packed codes moved
    # 4 or more bytes an access (their masks let Triton vectorise them: byte-wide accesses were 32 a thread)
    head = next(line for line in lines if line.startswith("| codec |")).strip("| ").split(" | ")
    codecs = [dict(zip(head, line.strip("| ").split(" | "))) for line in lines
              if line.startswith(("| kvcx ", "| reference "))]
    assert [(r["codec"].split()[1], r["kernel"]) for r in codecs] == \
        [(w, k) for w in ("keys", "values", "values") for k in ("encode", "decode")]
    for r in codecs:
        assert float(r["instructions / value"]) > 0 and int(r["registers"]) > 0
        assert ".U8" not in r["global accesses a thread"], r


def test_the_occupancy_rules_take_the_scarcest_resource():
    """sass_gpu.resident: the programs one sm_90 multiprocessor runs at once, by registers (allocated 256 a warp),
    shared memory (1 KiB reserved a program), warps (64) and programs (32), whichever allows the fewest."""
    from bench import sass_gpu as sass

    assert sass.resident(255, 20480, 2) == 4        # 255 registers: 8,192 a warp, 8 warps of 64K
    assert sass.resident(128, 22528, 4) == 4        # 4,096 a warp: 16 warps
    assert sass.resident(99, 14336, 4) == 4         # 99 -> 3,328 a warp (256s): 19 warps, 4 whole programs
    assert sass.resident(32, 100_000, 4) == 2       # shared memory: 2 x (100,000 + 1,024) of 233,472
    assert sass.resident(16, 0, 1) == 32            # the program limit
    assert sass.resident(16, 0, 4) == 16            # the warp limit: 64 warps


def test_the_hybrid_families_bench_runs_each_family_with_both_static_caches(tmp_path):
    """bench.bench_gpu_families (--smoke): a row for each family (sliding, sliding with sinks, chunked, MLA), each
    with both static caches measured (no failed or out-of-memory cell) and the packed cache's bytes beside
    StaticCache's."""
    from bench import bench_gpu_families

    out = tmp_path / "families.md"
    bench_gpu_families.main(["--smoke", "--markdown", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| family", "|--"))]
    assert [r.split(" | ")[0][2:] for r in rows] == ["Gemma 3", "GPT-OSS", "Llama 4 (chunked)", "DeepSeek V3 (MLA)"]
    for r in rows:
        cells = r.strip("| ").split(" | ")
        assert "failed" not in cells and "out of memory" not in cells, r
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and cells[9].endswith("x")
    for bad in (["--new", "0"], ["--prompts", "0"], ["--families", "Nope"]):   # one usage line each, before any work
        with pytest.raises(SystemExit):
            bench_gpu_families.main(["--smoke", *bad])
