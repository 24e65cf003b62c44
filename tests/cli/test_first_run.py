"""What a new user hits first: exit codes on a real cache, ratios against FP16, the order of checks."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvcx.formats import safetensors as kst

from helpers import run


@pytest.fixture(scope="module")
def real_cache(loaded, wikitext_path, tmp_path_factory):
    torch = pytest.importorskip("torch")
    from kvcx.quality.bridge import cache_to_tensors

    model, tok, _ = loaded
    ids = tok(wikitext_path.read_text(encoding="utf-8")[:40000])["input_ids"][:2048]
    assert len(ids) == 2048
    with torch.inference_mode():
        cache = model(torch.tensor(ids)[None], use_cache=True).past_key_values
    path = tmp_path_factory.mktemp("real") / "cache.safetensors"
    kst.save_file({k: v.astype(np.float16) for k, v in cache_to_tensors(cache).items()}, path)
    return path


@pytest.mark.model
def test_compress_exits_0_once_written_and_check_makes_it_a_gate(real_cache, tmp_path):
    out = tmp_path / "p.safetensors"
    r = run("compress", real_cache, out, "--group-size", "128", "--json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    # the reference design's absolute RMSE threshold is missed on this model's cache scale ...
    assert m["passed"] is False and any(v.startswith("RMSE") for v in m["violations"])
    # ... while the scale-free figures say the cache is fine
    assert m["relative_rmse"] < 0.1 and m["snr_db"] > 20
    assert m["relative_rmse"] == pytest.approx(10 ** (-m["snr_db"] / 20), rel=1e-9)
    assert out.is_file() and m["compressed_size_bytes"] == out.stat().st_size
    # FP16 input: the ratio vs FP16 is the file-size ratio up to the headers
    assert 3.5 < m["compression_ratio"] < 4.0
    assert m["compression_ratio"] == pytest.approx(m["fp16_size_bytes"] / m["compressed_size_bytes"])
    assert "Warning:" in r.stderr and "--check" in r.stderr

    r = run("compress", real_cache, out, "--group-size", "128")
    assert r.exit_code == 0 and "Warning:" in r.stderr and "FAILED" not in r.stdout, r.output

    r = run("compress", real_cache, tmp_path / "q.safetensors", "--group-size", "128", "--check")
    assert r.exit_code == 3 and "FAILED" in r.stdout, r.output
    assert (tmp_path / "q.safetensors").is_file()  # the file is still written

    r = run("metrics", real_cache, "--group-size", "128", "--json")
    assert r.exit_code == 3, r.output  # metrics is a check command
    assert json.loads(r.stdout)["passed"] is False


@pytest.mark.model
def test_fp32_cache_ratio_is_against_fp16(real_cache, tmp_path):
    f32 = tmp_path / "f32.safetensors"
    kst.save_file({k: np.asarray(v, dtype=np.float32) for k, v in kst.load_file(real_cache).items()}, f32)
    r = run("compress", f32, tmp_path / "p.safetensors", "--json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    assert 3.4 < m["compression_ratio"] < 3.8  # vs FP16, not vs the FP32 file
    assert m["file_size_ratio"] == pytest.approx(2 * m["compression_ratio"], rel=1e-3)
    assert m["bits_per_value"] == pytest.approx(16 / m["compression_ratio"], rel=1e-3)


def _validate_in_subprocess(args, env_extra=None):
    """kvcx validate in a fresh interpreter; reports whether torch got imported (the model load needs it)."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom kvcx.cli import app\n"
            f"r = CliRunner().invoke(app, ['validate', *{args!r}])\n"
            "print('EXIT', r.exit_code)\nprint('TORCH', 'torch' in sys.modules)\nprint(r.output)\n")
    env = {k: v for k, v in os.environ.items() if k != "KVCX_DATASET_FILE"}
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_validate_without_text_fails_before_the_model(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("the datasets package is installed: validate would try to download WikiText-2")
    out = _validate_in_subprocess(["--max-windows", "1"])
    assert "EXIT 1" in out and "TORCH False" in out, out
    assert "no evaluation text" in out and "--dataset-file" in out and "[1/6]" not in out and "[2/6]" not in out


def test_validate_missing_model_file_fails_before_the_model(tmp_path):
    text = tmp_path / "t.raw"
    text.write_text("hello world " * 100)
    out = _validate_in_subprocess(["--model", str(tmp_path / "nope.gguf"), "--dataset-file", str(text)])
    assert "EXIT 1" in out and "no such GGUF file" in out and "[2/6]" not in out, out


def test_validate_missing_text_is_reported_before_a_missing_model(tmp_path):
    out = _validate_in_subprocess(["--model", str(tmp_path / "nope.gguf"), "--dataset-file",
                                   str(tmp_path / "none.raw")])
    assert "EXIT 1" in out and "dataset file not found" in out and "TORCH False" in out, out
