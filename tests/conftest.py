import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
WIKITEXT = Path(os.environ.get("KVCX_WIKITEXT", ROOT.parent / "shared/data/wikitext-2-raw/wiki.test.raw"))


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
    from kvcx.models import embedded_model_path, load_model_and_tokenizer

    try:
        embedded_model_path()
    except ModelError as exc:
        pytest.skip(str(exc))
    return load_model_and_tokenizer(cpu=True)
