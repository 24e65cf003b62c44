"""bench.study_value_options: its joint plan's round trip gives the upgraded layers' values their own codec, the
rest the plan's, and counts every byte of both (the figures it scores are counted whole, as validate counts a plan)."""
import numpy as np

from bench.study_value_options import joint_roundtrip, value_codecs
from kvcx.api import load_plan
from kvcx.codecs import KVConfig
from kvcx.quality.bridge import roundtrip_tensors


def _cache(n_layers=3, seed=0):
    rng = np.random.default_rng(seed)
    return {f"layer_{L}_{kind}": rng.standard_normal((1, 3, 130, 64)).astype(np.float32)
            for L in range(n_layers) for kind in ("key", "value")}


def test_joint_roundtrip_splits_by_layer_and_counts_both_parts():
    tensors = _cache()
    plan = load_plan("smollm2-kvcx2v-2.12")
    int4 = value_codecs()["int4"]
    decoded, nbytes, stats = joint_roundtrip(plan, {1: int4})(tensors)
    assert set(decoded) == set(tensors)

    rest = {n: a for n, a in tensors.items() if n != "layer_1_value"}
    want_rest, rest_bytes, _ = roundtrip_tensors(rest, plan)
    want_v, v_bytes, _ = roundtrip_tensors({"layer_1_value": tensors["layer_1_value"]},
                                           KVConfig(key=int4, value=int4, scheme="study"))
    for name, arr in want_rest.items():
        np.testing.assert_array_equal(decoded[name], arr)
    np.testing.assert_array_equal(decoded["layer_1_value"], want_v["layer_1_value"])
    assert nbytes == rest_bytes + v_bytes
    # the upgraded layer's values decode closer than the plan's E8P values of the same data would
    e8p, _, _ = roundtrip_tensors({"layer_1_value": tensors["layer_1_value"]}, plan)
    err = lambda d: float(np.mean((d["layer_1_value"] - tensors["layer_1_value"]) ** 2))   # noqa: E731
    assert err(decoded) < err(e8p) / 4
    assert stats.n == sum(a.size for a in tensors.values())
