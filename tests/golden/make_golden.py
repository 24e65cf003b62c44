"""Regenerate the golden packed files (only when the format version changes on purpose).

    python tests/golden/make_golden.py
"""
from pathlib import Path

import numpy as np

from kvcx import safetensors_io as st
from kvcx.kvconfig import KVConfig
from kvcx.packed import compress_tensors

HERE = Path(__file__).resolve().parent


def golden_tensors():
    k = (np.arange(2 * 5 * 16, dtype=np.float32).reshape(1, 2, 5, 16) % 13 - 6) / 4
    v = (np.arange(2 * 5 * 16, dtype=np.float32).reshape(1, 2, 5, 16) % 7 - 3) / 2
    return {"layer_0_key": k.astype(np.float16), "layer_0_value": v.astype(np.float16),
            "positions": np.arange(5, dtype=np.int64)}


CASES = {
    "packed_reference_v2.safetensors": dict(scheme="reference", group_size=16),
    "packed_kvcx_v2.safetensors": dict(scheme="kvcx", group_size=16),
}


def build(name):
    packed, meta = compress_tensors(golden_tensors(), KVConfig.from_scheme(**CASES[name]))
    return st.save(packed, meta)


if __name__ == "__main__":
    for name in CASES:
        (HERE / name).write_bytes(build(name))
        print("wrote", HERE / name)
