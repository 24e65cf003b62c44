"""One model spread over a machine's devices (``--device auto``: transformers' ``device_map="auto"``): the
compressed cache goes back layer by layer to the device its layer was on, and the gate gives the one-device
result. This machine has no GPU: accelerate places every layer on the CPU, so the end-to-end test proves the code
path and its equality, and the per-layer placement is checked with torch's ``meta`` device."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcx.errors import KvcxError  # noqa: E402
from kvcx.quality import ranks  # noqa: E402
from kvcx.quality.bridge import rebuilt, tensor_devices  # noqa: E402


def test_a_rebuilt_cache_puts_each_layer_where_the_mapping_says():
    """rebuilt(..., {name: device}) places each decoded tensor on its own device (a spread model's layers), a
    single device places them all; tensor_devices reads the mapping back from a cache."""
    rng = np.random.default_rng(0)
    decoded = {f"layer_{i}_{kind}": rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
               for i in range(2) for kind in ("key", "value")}
    devices = {"layer_0_key": torch.device("cpu"), "layer_0_value": torch.device("cpu"),
               "layer_1_key": torch.device("meta"), "layer_1_value": torch.device("meta")}
    cache = rebuilt(None, decoded, devices)
    assert tensor_devices(cache) == devices
    assert torch.equal(cache.layers[0].keys, torch.from_numpy(decoded["layer_0_key"]))
    assert set(tensor_devices(rebuilt(None, decoded, torch.device("cpu"))).values()) == {torch.device("cpu")}


def test_device_auto_under_a_launcher_is_refused(monkeypatch):
    """Every rank would take all the GPUs: refused, naming the option and what to do instead."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KvcxError, match="--device auto spreads one model over this machine's GPUs, and every rank"):
        ranks.local_device("auto", cpu=False)
    assert ranks.local_device("cpu", cpu=False) == "cpu"


@pytest.mark.model
def test_validate_with_device_auto_gives_the_one_device_json(wikitext_path):
    """``kvcx validate --device auto`` (accelerate's placement: here every layer on the CPU) scores the same windows
    to the same figures as a plain run; calibrate takes the option too, --guard-retrieval refuses it."""
    args = [sys.executable, "-m", "kvcx", "validate", "--max-windows", "1", "--scheme", "kvcx,kvcx2",
            "--dataset-file", str(wikitext_path), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    one = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    spread = subprocess.run([*args, "--device", "auto"], capture_output=True, text=True, timeout=600, env=env)
    assert one.returncode in (0, 3) and spread.returncode == one.returncode, spread.stderr[-2000:]   # 3: kvcx2 fails
    timing = ("wall_time_s", "codec_time_s")
    a, b = json.loads(one.stdout), json.loads(spread.stdout)
    assert [{k: v for k, v in x.items() if k not in timing} for x in a] == \
        [{k: v for k, v in x.items() if k not in timing} for x in b]
    guard = subprocess.run([sys.executable, "-m", "kvcx", "calibrate", "--guard-retrieval", "8192", "--device", "auto",
                            "--out", os.devnull], capture_output=True, text=True, timeout=600, env=env)
    assert guard.returncode == 1 and "--device" in guard.stderr


def test_a_device_that_is_not_one_is_named():
    """--device bogus: one line naming the option and what it takes, before any model loads."""
    from kvcx.errors import ModelError
    from kvcx.quality.models import pick_device

    with pytest.raises(ModelError, match="--device 'bogus' is not a device: give cpu, cuda, cuda:N or auto"):
        pick_device("bogus")
    assert pick_device("auto", cpu=True).type == "cpu" and pick_device("cpu").type == "cpu"
