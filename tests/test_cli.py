"""The Typer CLI through CliRunner: outputs, --json, exit codes and error paths."""
import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from kvcx import __version__
from kvcx import safetensors_io as kst
from kvcx.cli import app
from test_packed import tinyllama_cache

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def cache(tmp_path):
    p = tmp_path / "cache.safetensors"
    kst.save_file(tinyllama_cache(seq=64), p)
    return p


def test_version_and_help():
    r = run("--version")
    assert r.exit_code == 0 and __version__ in r.output
    r = run("-h")
    assert r.exit_code == 0 and "compress" in r.output and "validate" in r.output


def test_info_json():
    r = run("info", "--json")
    assert r.exit_code == 0, r.output
    i = json.loads(r.stdout)
    assert isinstance(i["openmp"], bool) and i["max_threads"] >= 1


def test_compress_decompress_metrics_json(cache, tmp_path):
    out = tmp_path / "p.safetensors"
    r = run("compress", cache, out, "--group-size", "128", "--scheme", "reference", "--json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    for k in ("compression_ratio", "original_size_bytes", "compressed_size_bytes", "rmse", "snr_db",
              "cosine_similarity", "max_error", "quality_level", "processing_time_ms", "passed", "violations"):
        assert k in m
    assert m["compressed_size_bytes"] == out.stat().st_size
    assert m["config"]["codecs"]["key"]["group_size"] == 128
    r = run("decompress", out, tmp_path / "r.safetensors", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tensors"] == 44
    r = run("metrics", cache, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["passed"] is True


def test_human_output_has_table(cache, tmp_path):
    r = run("compress", cache, tmp_path / "p.safetensors")
    assert r.exit_code == 0, r.output
    assert "compression ratio" in r.stdout and "PASSED" in r.stdout and "layer_0_key" in r.stdout


def test_quality_failure_exit_code(cache):
    r = run("metrics", cache, "--min-snr", "60", "--json")
    assert r.exit_code == 3, r.output
    assert json.loads(r.stdout)["passed"] is False


@pytest.mark.parametrize("args,message", [
    (["compress", "{tmp}/missing.safetensors", "{tmp}/o.safetensors"], "no such file; check the path"),
    (["compress", "{cache}", "{cache}"], "output is the input file"),
    (["compress", "{cache}", "{tmp}/o.safetensors", "--group-size", "48"], "group size 48 is not supported"),
    (["compress", "{cache}", "{tmp}/o.safetensors", "--scheme", "nf4"], "unknown scheme 'nf4'"),
    (["compress", "{cache}", "{tmp}/nodir/o.safetensors"], "does not exist; create it first"),
    (["compress", "{cache}", "{tmp}/o.safetensors", "--sparsity", "1.5"], "sparsity must be in"),
    (["compress", "{cache}", "{tmp}/o.safetensors", "--threads", "0"], "n_threads must be a positive integer"),
    (["compress", "{notst}", "{tmp}/o.safetensors"], "not valid JSON|exceeds|truncated|not a safetensors"),
    (["decompress", "{cache}", "{tmp}/o.safetensors"], "plain safetensors file, not a kvcx packed file"),
    (["metrics", "{tmp}"], "is a directory"),
    (["validate", "--dataset-file", "{tmp}/none.raw"], "dataset file not found"),
    (["validate", "--mode", "beam", "--dataset-file", "{cache}"], "--mode must be 'prefix' or 'generation'"),
])
def test_errors_are_one_red_line(cache, tmp_path, args, message):
    notst = tmp_path / "notes.txt"
    notst.write_text("hello, this is not safetensors at all")
    args = [a.format(tmp=tmp_path, cache=cache, notst=notst) for a in args]
    r = run(*args)
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    import re

    assert re.search(message, r.output.replace("\n", " ")), r.output
    assert "Error:" in r.output


def test_packed_input_to_compress(cache, tmp_path):
    p = tmp_path / "p.safetensors"
    assert run("compress", cache, p).exit_code == 0
    r = run("compress", p, tmp_path / "q.safetensors")
    assert r.exit_code == 1 and "already a kvcx packed file" in r.output


def test_failed_compress_keeps_existing_output(tmp_path, cache):
    good = tmp_path / "good.safetensors"
    assert run("compress", cache, good).exit_code == 0
    before = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    kst.save_file({"layer_0_value": np.array([[np.inf, 1.0]], np.float32)}, bad)
    r = run("compress", bad, good)
    assert r.exit_code == 1 and "NaN/Inf" in r.output
    assert good.read_bytes() == before
    assert not list(tmp_path.glob(".kvcx-*"))


def test_quick_test_json():
    r = run("validate", "--quick-test", "--json")
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)
    assert v["passed"] is True and v["quick_test"] is True and v["snr_db"] > 18
    for k in ("baseline_perplexity", "compressed_perplexity", "delta", "delta_percent", "compression_ratio", "rmse",
              "snr_db", "cosine_similarity", "passed", "threshold"):
        assert k in v


def test_quick_test_reference_fails_thresholds_on_outlier_keys():
    r = run("validate", "--quick-test", "--scheme", "reference", "--quiet")
    assert r.exit_code == 3 and "FAILED" in r.output


def test_light_commands_do_not_import_torch(cache, tmp_path):
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom kvcx.cli import app\n"
            f"r = CliRunner().invoke(app, ['compress', {str(cache)!r}, {str(tmp_path / 'x.safetensors')!r}])\n"
            f"r2 = CliRunner().invoke(app, ['metrics', {str(cache)!r}])\n"
            "assert r.exit_code == 0 and r2.exit_code == 0, r.output + r2.output\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "kvcx", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout


def test_dataset_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCX_DATASET_FILE", str(tmp_path / "missing.raw"))
    r = run("validate", "--max-windows", "1")
    assert r.exit_code == 1 and "missing.raw: dataset file not found" in r.output


def test_window_errors_come_before_loading_the_model(tmp_path):
    r = run("validate", "--window", "512", "--stride", "600", "--dataset-file", str(tmp_path / "x.raw"))
    assert r.exit_code == 1 and "--stride (600) must be smaller than --window (512)" in r.output
    assert "[1/6]" not in r.output
