"""Regenerate the golden packed files (only when the format version changes on purpose).

    python tests/golden/make_golden.py
"""
from pathlib import Path

import numpy as np

from kvcx.codecs.intcodec import IntCodec
from kvcx.codecs.kvconfig import KVConfig
from kvcx.formats import safetensors as st
from kvcx.formats.packed import compress_tensors

HERE = Path(__file__).resolve().parent


def golden_tensors():
    k = (np.arange(2 * 5 * 16, dtype=np.float32).reshape(1, 2, 5, 16) % 13 - 6) / 4
    v = (np.arange(2 * 5 * 16, dtype=np.float32).reshape(1, 2, 5, 16) % 7 - 3) / 2
    return {"layer_0_key": k.astype(np.float16), "layer_0_value": v.astype(np.float16),
            "positions": np.arange(5, dtype=np.int64)}


def _kvcx_before_value_sinks():
    """The default scheme as it was when packed_kvcx_v2 was written (values without the sink token)."""
    cfg = KVConfig.from_scheme("kvcx", group_size=16)
    return KVConfig(key=cfg.key, value=IntCodec.from_config({**cfg.value.get_config(), "sinks": 0}), scheme="kvcx")


CASES = {
    "packed_reference_v2.safetensors": lambda: KVConfig.from_scheme("reference", group_size=16),
    "packed_kvcx_v2.safetensors": _kvcx_before_value_sinks,
    "packed_kvcx_vsink_v2.safetensors": lambda: KVConfig.from_scheme("kvcx", group_size=16),
}


def build(name):
    packed, meta, _ = compress_tensors(golden_tensors(), CASES[name]())
    return st.save(packed, meta)


if __name__ == "__main__":
    for name in CASES:
        (HERE / name).write_bytes(build(name))
        print("wrote", HERE / name)
