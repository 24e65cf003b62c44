"""Other libraries' quantizers as validate settings (kvcx[peers]: optimum-quanto and hqq through transformers,
fused-turboquant, nexusquant-kv), on the same windows and tokens as kvcx's codecs. CI installs the extra: never skipped."""
import json

import numpy as np
import pytest

from kvcx.api import validation_settings
from kvcx.errors import KvcxError
from kvcx.quality.peers import PEERS, PeerSetting, roundtrip_of

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from kvcx.cli import app  # noqa: E402
from kvcx.quality.validation import run_validations  # noqa: E402


def test_peer_round_trips_count_their_bytes_and_errors():
    rng = np.random.default_rng(0)
    tensors = {f"layer_0_{k}": rng.standard_normal((1, 3, 40, 64)).astype(np.float32) for k in ("key", "value")}
    values = sum(a.size for a in tensors.values())
    errors = {}
    for name, bits_per_value in (("quanto-int4", 4.5), ("quanto-int2", 2.5), ("hqq-int4", 4.5), ("hqq-int2", 2.5),
                                 ("hqq-int4-axis1", 4.5), ("hqq-int2-axis1", 2.5), ("turboquant-4", 4.5),
                                 ("turboquant-3", 3.5)):
        decoded, nbytes, stats = PEERS[name].roundtrip(tensors)
        assert set(decoded) == set(tensors) and all(decoded[k].shape == tensors[k].shape for k in tensors)
        assert 8 * nbytes / values == pytest.approx(bits_per_value, abs=0.02)   # codes + scales / norms
        assert stats.n == values and 0 < stats.relative_rmse < 0.6
        errors[name] = stats.relative_rmse
    assert errors["quanto-int2"] > errors["quanto-int4"] and errors["turboquant-3"] > errors["turboquant-4"]
    assert errors["hqq-int2"] > errors["hqq-int4"] and errors["hqq-int2-axis1"] > errors["hqq-int4-axis1"]
    again = roundtrip_of(PEERS["quanto-int4"])(tensors)       # what validate runs: the same library call
    assert all(np.array_equal(again[0][k], PEERS["quanto-int4"].roundtrip(tensors)[0][k]) for k in tensors)


def test_nexusquant_writes_e8_lattice_points_at_its_widths_and_counts_a_packed_index():
    """NexusQuant's quant-only path through its package: each value vector, Hadamard-rotated and divided by its
    scale (amax / (L / 2)), decodes to half-integers in [-L/2, L/2] (its E8 points at L = 2^bits levels; FP16
    writes leave 0.005); bits per value: log2((L+1)^8 + (L+2)^8) / 8 + an FP16 scale per vector of 64."""
    from scipy.linalg import hadamard
    from transformers import LlamaConfig

    from kvcx.quality.peers import e8_index_bits

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2, head_dim=64)
    rng = np.random.default_rng(0)
    tensors = {f"layer_{i}_{k}": rng.standard_normal((1, 2, 24, 64)).astype(np.float32)
               for i in range(2) for k in ("key", "value")}
    H = hadamard(64) / 8.0
    errors = {}
    for scheme, kb, vb in (("nexusquant-k4v4", 4, 4), ("nexusquant-k3v2", 3, 2), ("nexusquant-k2v2", 2, 2)):
        decoded, nbytes, stats = roundtrip_of(PEERS[scheme], cfg)(tensors)
        values = sum(a.size for a in tensors.values())
        assert 8 * nbytes / values == pytest.approx((e8_index_bits(kb) + e8_index_bits(vb)) / 2 + 0.25, abs=1e-3)
        v, got = tensors["layer_1_value"].reshape(-1, 64) @ H, decoded["layer_1_value"].reshape(-1, 64) @ H
        doubled = 2 * got / (np.abs(v).max(-1, keepdims=True) / 2 ** (vb - 1))
        assert np.abs(doubled - np.round(doubled)).max() < 0.01 and np.abs(np.round(doubled)).max() == 2 ** vb
        errors[scheme] = stats.relative_rmse
    assert errors["nexusquant-k4v4"] < errors["nexusquant-k3v2"] < errors["nexusquant-k2v2"] < 0.5
    assert [round(e8_index_bits(b) + 0.25, 2) for b in (2, 3, 4)] == [2.87, 3.64, 4.51]
    with pytest.raises(KvcxError, match="needs the model's config"):
        PEERS["nexusquant-k3v2"].roundtrip(tensors)
    with pytest.raises(KvcxError, match="layers 0..n-1, each a key and a value"):
        PEERS["nexusquant-k3v2"].roundtrip({"layer_1_key": tensors["layer_1_key"]}, model_config=cfg)


@pytest.mark.parametrize("scheme,axis", [("quanto-int4", 0), ("quanto-int2", 0), ("hqq-int4", 0), ("hqq-int2", 0),
                                         ("hqq-int4-axis1", 1), ("hqq-int2-axis1", 1)])
def test_peer_layers_decode_what_transformers_quantized_cache_serves(scheme, axis):
    """The round trip equals what transformers' own QuantizedCache(backend=...) returns after a prefill of the
    same keys and values (groups of 64, its default axis 0 or HQQ's axis 1), bit for bit."""
    from transformers import LlamaConfig
    from transformers.cache_utils import QuantizedCache

    backend, nbits = PEERS[scheme].library, PEERS[scheme].bits
    rng = np.random.default_rng(nbits)
    k, v = (rng.standard_normal((1, 3, 200, 64)).astype(np.float32) * 2 for _ in range(2))
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, hidden_size=192)
    cache = QuantizedCache(backend=backend, config=config, nbits=nbits, **({"axis_key": 1, "axis_value": 1} if axis
                                                                            else {}))
    cache.update(torch.from_numpy(k), torch.from_numpy(v), 0)         # a prefill: quantizes all 200 tokens
    keys, values = cache.update(torch.zeros(1, 3, 1, 64), torch.zeros(1, 3, 1, 64), 0)
    decoded, _, _ = PEERS[scheme].roundtrip({"k": k, "v": v})
    np.testing.assert_array_equal(decoded["k"], keys[:, :, :200].numpy())
    np.testing.assert_array_equal(decoded["v"], values[:, :, :200].numpy())


@pytest.mark.parametrize("nbits", [4, 2])
def test_hqq_groups_are_64_values_numel_over_64_apart(nbits):
    """HQQ's axis 0 (transformers' default) views the tensor as [64, numel / 64] and gives each column a scale
    and a zero point: each column decodes to at most 2**nbits levels on one affine grid."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 48, 64)).astype(np.float32)
    d, _, _ = PEERS[f"hqq-int{nbits}"].roundtrip({"k": x})
    cols = d["k"].reshape(64, -1)
    for j in range(0, cols.shape[1], 97):
        levels = np.unique(cols[:, j])
        assert len(levels) <= 2 ** nbits
        steps = np.diff(levels)
        assert np.allclose(steps / steps.min(), np.round(steps / steps.min()), atol=1e-3)
    assert np.abs(d["k"] - x).max() < 2 * np.abs(x).max()
    rows = PEERS[f"hqq-int{nbits}-axis1"].roundtrip({"k": x})[0]["k"].reshape(-1, 64)   # axis 1: a token's head dim
    assert all(len(np.unique(r)) <= 2 ** nbits for r in rows[::37])
    assert PEERS["hqq-int4-axis1"].get_config() == {"id": "peer", "library": "hqq", "bits": 4, "axis": 1}
    with pytest.raises(KvcxError, match="groups of 64"):
        PEERS["hqq-int4"].roundtrip({"layer_0_key": rng.standard_normal((1, 1, 3, 7)).astype(np.float32)})


def test_peer_settings_are_named_and_refuse_kvcx_options():
    configs, gated = validation_settings("kvcx,quanto-int4,turboquant-3", peers=PEERS)
    assert list(configs) == ["kvcx", "quanto-int4", "turboquant-3"] and gated == list(configs)
    assert configs["quanto-int4"] == PeerSetting("quanto", 4) and configs["turboquant-3"].get_config() == {
        "id": "peer", "library": "turboquant", "bits": 3}
    with pytest.raises(KvcxError, match="own settings; leave out bits=3"):
        validation_settings("quanto-int4", bits=3, peers=PEERS)
    with pytest.raises(KvcxError, match="unknown scheme|not one of|scheme"):
        validation_settings("quanto-int4")           # without the peers, not a kvcx scheme
    with pytest.raises(KvcxError, match=r"unknown scheme 'hqq-int8'; use one of reference, .*q4_0, .*another library's: .*hqq-int4"):
        validation_settings("kvcx,hqq-int8", peers=PEERS)   # a typo names kvcx's schemes and the peers


def test_peers_beside_kvcx_on_the_same_tokens(loaded, wikitext_path):
    configs, _ = validation_settings("kvcx,quanto-int4,quanto-int2,hqq-int4,turboquant-3", peers=PEERS)
    r = {x.setting: x for x in run_validations(configs, max_windows=1, dataset_file=wikitext_path, loaded=loaded)}
    assert len({x.baseline_perplexity for x in r.values()}) == 1 and r["kvcx"].tokens_scored == 511
    assert 0 < r["kvcx"].kld < r["quanto-int4"].kld < r["quanto-int2"].kld
    assert 0 < r["hqq-int4"].kld < r["quanto-int2"].kld and r["hqq-int4"].bits_per_value == 4.5
    assert r["turboquant-3"].bits_per_value == pytest.approx(3.5, abs=0.02) and r["turboquant-3"].kld > 0
    assert r["quanto-int4"].config == {"id": "peer", "library": "quanto", "bits": 4}
    with pytest.raises(KvcxError, match="prefix mode only"):
        run_validations(configs, max_windows=1, dataset_file=wikitext_path, loaded=loaded, mode="engine")


def test_cli_validate_with_a_peer(wikitext_path):
    r = CliRunner().invoke(app, ["validate", "--scheme", "kvcx,quanto-int4", "--max-windows", "1", "--json",
                                 "--dataset-file", str(wikitext_path)])
    assert r.exit_code in (0, 3), r.output
    rows = json.loads(r.stdout)
    assert [x["setting"] for x in rows] == ["kvcx", "quanto-int4"] and rows[1]["bits_per_value"] == 4.5
    r = CliRunner().invoke(app, ["compress", str(wikitext_path), "out.safetensors", "--scheme", "quanto-int4"])
    assert r.exit_code == 1 and "quanto-int4" in r.output and "Traceback" not in r.output
