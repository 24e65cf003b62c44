"""Other libraries' quantizers as validate settings (kvcx[peers]: optimum-quanto through transformers,
fused-turboquant), on the same windows and tokens as kvcx's codecs. CI installs the extra: never skipped."""
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
    for name, bits_per_value in (("quanto-int4", 4.5), ("quanto-int2", 2.5), ("turboquant-4", 4.5),
                                 ("turboquant-3", 3.5)):
        decoded, nbytes, stats = PEERS[name].roundtrip(tensors)
        assert set(decoded) == set(tensors) and all(decoded[k].shape == tensors[k].shape for k in tensors)
        assert 8 * nbytes / values == pytest.approx(bits_per_value, abs=0.02)   # codes + scales / norms
        assert stats.n == values and 0 < stats.relative_rmse < 0.6
        errors[name] = stats.relative_rmse
    assert errors["quanto-int2"] > errors["quanto-int4"] and errors["turboquant-3"] > errors["turboquant-4"]
    assert roundtrip_of(PEERS["quanto-int4"]) == PEERS["quanto-int4"].roundtrip


def test_peer_settings_are_named_and_refuse_kvcx_options():
    configs, gated = validation_settings("kvcx,quanto-int4,turboquant-3", peers=PEERS)
    assert list(configs) == ["kvcx", "quanto-int4", "turboquant-3"] and gated == list(configs)
    assert configs["quanto-int4"] == PeerSetting("quanto", 4) and configs["turboquant-3"].get_config() == {
        "id": "peer", "library": "turboquant", "bits": 3}
    with pytest.raises(KvcxError, match="own settings; leave out bits=3"):
        validation_settings("quanto-int4", bits=3, peers=PEERS)
    with pytest.raises(KvcxError, match="unknown scheme|not one of|scheme"):
        validation_settings("quanto-int4")           # without the peers, not a kvcx scheme


def test_peers_beside_kvcx_on_the_same_tokens(loaded, wikitext_path):
    configs, _ = validation_settings("kvcx,quanto-int4,quanto-int2,turboquant-3", peers=PEERS)
    r = {x.setting: x for x in run_validations(configs, max_windows=1, dataset_file=wikitext_path, loaded=loaded)}
    assert len({x.baseline_perplexity for x in r.values()}) == 1 and r["kvcx"].tokens_scored == 511
    assert 0 < r["kvcx"].kld < r["quanto-int4"].kld < r["quanto-int2"].kld
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
