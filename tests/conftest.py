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
