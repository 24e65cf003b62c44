"""The Typer CLI through CliRunner: outputs, --json, exit codes and error paths."""
import json
import subprocess
import sys

import numpy as np
import pytest

from kvcx import __version__
from kvcx.api import load_plan
from kvcx.codecs import KVConfig
from kvcx.errors import KvcxError
from kvcx.formats import safetensors as kst

from helpers import app, plan_config, run, runner, tinyllama_cache


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


def test_help_keeps_the_extras_names():
    """Rich markup reads '[peers]' as a style tag and drops it unless escaped: help must say which extra to install."""
    for command, extra in (("validate", "kvcx[peers]"), ("validate", "kvcx[plot]"), ("metrics", "kvcx[plot]")):
        r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
        assert r.exit_code == 0 and extra in r.output, (command, extra)


def test_flags_show_no_type():
    """Typer prints ``<bool>`` in a flag's type column (as if it took a value): kvcx's own flags leave it empty, in
    every command's help (Typer's own ``-h/--help`` row keeps it)."""
    for command in (None, "compress", "metrics", "validate", "calibrate"):
        r = runner.invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        rows = [line for line in r.output.splitlines() if "<bool>" in line]
        assert all("--help" in line for line in rows), (command, rows)
        assert any("--json" in line or "--version" in line for line in r.output.splitlines()), command


def test_info_json():
    r = run("info", "--json")
    assert r.exit_code == 0, r.output
    i = json.loads(r.stdout)
    assert isinstance(i["openmp"], bool) and i["max_threads"] >= 1


def test_a_command_quiets_what_transformers_imports_say_at_import():
    """torchao, which transformers imports wherever it is installed (the test extra installs it), logs "Failed to
    load" for its CUDA extensions on a CPU build of torch, and torch's pytree a deprecation for its enums: after any
    command starts (here info) those loggers are at ERROR, and importing them prints nothing."""
    pytest.importorskip("transformers")
    code = ("import logging\n"
            "from typer.testing import CliRunner\n"
            "from kvcx.cli import app\n"
            "assert CliRunner().invoke(app, ['info', '--json']).exit_code == 0\n"
            "import transformers.quantizers.auto  # torchao, where it is installed\n"
            "from kvcx.cli.app import QUIET_LOGGERS\n"
            "print([logging.getLogger(n).getEffectiveLevel() for n in QUIET_LOGGERS])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[40, 40]", p.stdout
    assert "Failed to load" not in p.stderr and "Enum subclass" not in p.stderr, p.stderr[-2000:]


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
    (["validate", "--mode", "beam", "--dataset-file", "{cache}"], "--mode beam must be one of 'prefix', 'generation', 'engine'"),
    (["validate", "--backend", "gpu", "--dataset-file", "{cache}"], "backend 'gpu' is not supported; use one of cpu, triton"),
    (["validate", "--backend", "triton", "--scheme", "kvcx3", "--dataset-file", "{cache}"],
     "--backend triton runs 4-bit integer, E8P and widths codecs; this setting has 3-bit"),
    (["validate", "--backend", "triton", "--quick-test"], "--task passkey and --quick-test do not take it"),
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
    assert r.exit_code == 1 and "--stride 600 must be smaller than --window 512" in r.output
    assert "[1/6]" not in r.output


def test_library_errors_name_parameters_and_the_cli_its_flags(small_cache_file, tmp_path):
    """The library says ``window=1``; the CLI says ``--window 1``, for the options of the running command."""
    from kvcx.cli import in_flags
    from kvcx.quality.scoring import check_window

    with pytest.raises(KvcxError, match=r"^window=1 and stride=512 must be at least 2$"):
        check_window(1, 512, 1, 2048)
    r = run("validate", "--window", "1", "--dataset-file", str(tmp_path / "x.raw"))
    assert r.exit_code == 1 and "--window 1 and --stride 512 must be at least 2" in r.output, r.output
    r = run("compress", small_cache_file, tmp_path / "b.safetensors", "--scheme", "kvcx2w", "--bits", "3")
    assert r.exit_code == 1 and "--scheme kvcx2w sets its own bits and rotation; leave them out, or use --scheme kvcx2" in r.output
    assert in_flags("pass rotate=False", "compress") == "pass --no-rotate"
    assert in_flags("pass rotate=True, or sinks=2", "compress") == "pass --rotate, or --sinks 2"
    assert in_flags("max_windows=-1 must be >= 0", "validate") == "--max-windows -1 must be >= 0"
    # names the command has no option for, and text that only looks like a parameter, stay as they are
    assert in_flags("window=1 here; x=2", "compress") == "window=1 here; x=2"
    assert in_flags("window=1", None) == "window=1"


def test_cli_plan_files_compress_decompress_metrics(cache128, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"config": plan_config().get_config(), "budget": 3.5}))
    packed_path, restored = tmp_path / "p.safetensors", tmp_path / "r.safetensors"
    r = run("compress", cache128, packed_path, "--plan", plan, "--json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    assert set(m["config"]["codecs"]) >= {"key", "value", "key.b4", "value.b2"}
    assert run("decompress", packed_path, restored).exit_code == 0
    orig, back = kst.load_file(cache128), kst.load_file(restored)
    assert set(orig) == set(back) and all(back[k].shape == orig[k].shape for k in orig)
    # Hugging Face's reader sees plain tensors
    safetensors = pytest.importorskip("safetensors.numpy")
    assert "layer_2_key.kvcx.codes" in safetensors.load_file(str(packed_path))
    for scheme in ("kvcx3", "kvcx2"):
        r = run("metrics", cache128, "--scheme", scheme, "--json", "--min-snr", "0", "--max-rmse", "10",
                "--min-cosine", "0")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["config"]["scheme"] == scheme
    # bad plans: one red line, exit 1
    for text, msg in [(None, "no such plan file"), ("{", "not valid JSON"),
                      (json.dumps({"config": {"key": {}, "value": {}, "layer_bits": [[1, 9, 4]]}}), "not one of")]:
        p = tmp_path / "bad.json"
        if text is not None:
            p.write_text(text)
        elif p.exists():
            p.unlink()
        r = run("compress", cache128, tmp_path / "x.safetensors", "--plan", p)
        assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output, r.output
    assert isinstance(load_plan(plan), KVConfig)


@pytest.mark.parametrize("args,message", [
    (["--threads", "2147483648"], "n_threads must be a positive integer up to"),
    (["--threads", "10000"], "n_threads must be a positive integer up to"),
    (["--sinks", str(2 ** 70)], "sinks must be a non-negative integer"),
    (["--sinks", "-1"], "sinks must be a non-negative integer"),
    (["--group-size", "3"], "group size 3 is not supported"),
])
def test_bad_option_values_exit_1(small_cache_file, tmp_path, args, message):
    for cmd in (["compress", small_cache_file, tmp_path / "o.safetensors"], ["metrics", small_cache_file]):
        r = run(*cmd, *args)
        assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o.safetensors").exists()


def test_errors_do_not_start_with_a_blank_line(small_cache_file, tmp_path):
    r = run("compress", small_cache_file, tmp_path / "nodir" / "o.safetensors")
    assert r.exit_code == 1 and r.output.startswith("Error: "), repr(r.output)
    assert "o.safetensors: the output directory" in r.output


def test_progress_off_a_terminal_is_plain_lines(capsys):
    """`make validate` into a log or CI: a line at each tenth of the windows (every window when there are few),
    never a bar's control codes, nothing at all with --json."""
    from kvcx.cli.render import window_bar

    with window_bar(False) as on_window:
        for i in range(1, 33):
            on_window(i, 32)
    lines = capsys.readouterr().err.splitlines()
    assert [x.split(" (")[0] for x in lines] == [f"windows {i}/32" for i in (3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 32)]
    assert all("\x1b" not in x and x.endswith("s)") for x in lines)
    with window_bar(False, "prompts") as on_prompt:
        for i in range(1, 4):
            on_prompt(i, 3)
    assert [x.split(" (")[0] for x in capsys.readouterr().err.splitlines()] == ["prompts 1/3", "prompts 2/3",
                                                                               "prompts 3/3"]
    with window_bar(True) as on_window:
        assert on_window is None
