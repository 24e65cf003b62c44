"""The torch bridge: caches saved and loaded as kvcx tensor files."""

import numpy as np
import pytest

from kvcx.errors import KvcxError
from kvcx.formats import safetensors as kst


@pytest.mark.parametrize("shape", [(16,), (2, 8, 16), (1, 1, 2, 8, 16)])
def test_load_kv_cache_rejects_non_4d(tmp_path, shape):
    pytest.importorskip("torch")
    from kvcx.quality.bridge import load_kv_cache

    p = tmp_path / "c.safetensors"
    kst.save_file({"layer_0_key": np.zeros(shape, np.float16), "layer_0_value": np.zeros(shape, np.float16)}, p)
    with pytest.raises(KvcxError, match=r"c.safetensors: KV cache tensor 'layer_0_key' has shape"):
        load_kv_cache(p)
