import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The Triton kernels run in Triton's interpreter on CPU tensors where there is no GPU (CI): set before the
# kernels are first imported. On a CUDA machine they compile and run on the GPU.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        _cuda = torch.cuda.is_available()
    except ImportError:
        _cuda = False
    if not _cuda:
        os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
WIKITEXT = Path(os.environ.get("KVCX_WIKITEXT", ROOT.parent / "shared/data/wikitext-2-raw/wiki.test.raw"))

# The slow tier, left out by `make test` (the fast tier: units, formats, CLI, codecs) and run by `make test-all`
# (what CI runs): tests that load the model, start servers, run Triton's interpreter or calibrate. A test is slow
# when it is marked model or engine, uses the `loaded` model, or lives in one of these files.
SLOW_FILES = ("cache/test_kvcx_cache.py", "cache/test_families.py", "cache/test_device_cache.py", "cache/test_static_cache.py", "codecs/test_triton.py",
              "codecs/test_triton_compile.py", "codecs/test_triton_e8p.py", "integrations/test_fleet.py", "integrations/test_vllm_engine.py",
              "cli/test_first_run.py", "test_bench_gpu.py", "test_bench_mla.py", "test_bench_families.py", "quality/")
TESTS = Path(__file__).resolve().parent


# The longest files first (about 50 s or more each on 2 cores, longest first): `make test-all` runs the files on
# two workers (pytest-xdist, a file a worker, the next file to whichever is free), so the long ones start early
# and no worker is left alone on one at the end. Order only: every file still runs whole, in its own order.
LONGEST_FIRST = ("integrations/test_vllm_engine.py", "quality/test_ranks.py", "cache/test_kvcx_cache.py",
                 "cache/test_static_cache.py", "integrations/test_fleet.py", "quality/test_validation.py",
                 "codecs/test_triton.py", "cache/test_families.py", "test_bench_gpu.py", "quality/test_calibrate.py")


def pytest_collection_modifyitems(config, items):
    rank = {}
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
        if item.get_closest_marker("model") or item.get_closest_marker("engine") or \
                "loaded" in getattr(item, "fixturenames", ()) or rel.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)
        rank[item.nodeid] = LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=lambda item: rank[item.nodeid])   # stable: the rest keep their order


# Seconds each test file held a worker (setup, call and teardown of its tests, its module fixtures included), added
# from the reports the workers send: with --durations (test-all, CI) the longest files are listed after the slowest
# tests, the figures LONGEST_FIRST is ordered by and CI's time budget is cut from.
_FILE_SECONDS = defaultdict(float)


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("durations", None) is None or not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"longest 15 files ({total:.0f} worker-seconds in all)")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {name}")


@pytest.fixture(scope="session")
def wikitext_path():
    if not WIKITEXT.is_file():
        pytest.skip(f"WikiText-2 test file not found at {WIKITEXT} (set KVCX_WIKITEXT)")
    return WIKITEXT


@pytest.fixture(scope="session")
def loaded():
    """(model, tokenizer, name) of the embedded SmolLM2-135M on CPU, loaded once per test session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcx.errors import ModelError
    from kvcx.quality.models import embedded_model_path, load_model_and_tokenizer

    try:
        embedded_model_path()
    except ModelError as exc:
        pytest.skip(str(exc))
    return load_model_and_tokenizer(cpu=True)


@pytest.fixture
def small_cache_file(tmp_path):
    """A small FP16 cache with a pass-through tensor, metadata and a sidecar."""
    import json

    from kvcx.formats import safetensors as kst

    from helpers import small_cache

    p = tmp_path / "in.safetensors"
    kst.save_file(small_cache(), p, {"origin": "test"})
    (tmp_path / "in.safetensors.metadata.json").write_text(json.dumps({"model_name": "m", "seq_len": 8}))
    return p


@pytest.fixture
def cache128(tmp_path):
    """A TinyLlama-shaped FP16 cache of 128 tokens (22 layers x [1, 4, 128, 64])."""
    from kvcx.formats import safetensors as kst

    from helpers import tinyllama_cache

    p = tmp_path / "cache.safetensors"
    kst.save_file(tinyllama_cache(seq=128), p)
    return p


@pytest.fixture
def cache_file(tmp_path):
    """A TinyLlama-shaped FP16 cache of 128 tokens with the reference layout's metadata sidecar."""
    import json

    from kvcx.formats import safetensors as kst

    from helpers import tinyllama_cache

    p = tmp_path / "cache.safetensors"
    kst.save_file(tinyllama_cache(), p)
    (tmp_path / "cache.safetensors.metadata.json").write_text(json.dumps(
        {"num_layers": 22, "num_kv_heads": 4, "seq_len": 128, "head_dim": 64, "dtype": "float16",
         "model_name": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}))
    return p
