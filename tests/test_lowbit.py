"""The low-bit frontier: kvcx3/kvcx2 presets, per-layer widths (layer_bits), plans from `kvcx calibrate`,
the per-head SNR heatmap of `kvcx metrics --plot`."""
import json
from pathlib import Path

import numpy as np
import pytest

from kvcx import safetensors_io as kst
from kvcx.api import head_snr_grid, load_plan
from kvcx.calibrate import allocate
from kvcx.codec import IntCodec
from kvcx.errors import CodecError, KvcxError
from kvcx.kvconfig import KVConfig, layer_of
from kvcx.metrics import error_stats
from kvcx.packed import compress_tensors, decompress_tensors, packed_tensors
from test_cli import run
from test_packed import tinyllama_cache


@pytest.fixture
def cache(tmp_path):
    p = tmp_path / "cache.safetensors"
    kst.save_file(tinyllama_cache(seq=128), p)
    return p


PLANS = Path(__file__).resolve().parents[1] / "bench" / "plans"


def plan_config(scheme="kvcx3", layer_bits=((2, 4, 4), (5, 4, 3), (7, 3, 2))):
    base = KVConfig.from_scheme(scheme)
    return KVConfig(key=base.key, value=base.value, scheme=scheme, layer_bits=layer_bits, variants=base.variants)


def test_layer_of_names():
    assert layer_of("layer_12_key") == 12
    assert layer_of("past_key_values.3.0") == 3
    assert layer_of("model.layers.7.self_attn.v_cache") == 7
    assert layer_of("blocks.2.k") == 2
    assert layer_of("key") is None and layer_of("player9_key") is None


@pytest.mark.parametrize("scheme,bits", [("kvcx3", 3), ("kvcx2", 2)])
def test_presets_roundtrip_through_the_file_format(scheme, bits):
    cfg = KVConfig.from_scheme(scheme)
    assert cfg.key.bits == bits and cfg.value.bits == bits and cfg.key.sinks == cfg.value.sinks == 1
    assert cfg.value.rotate
    tensors = tinyllama_cache(seq=128)
    packed, meta = compress_tensors(tensors, cfg)
    blob = kst.save(packed, meta)
    loaded, loaded_meta = kst.load_with_metadata(blob)
    out = decompress_tensors(loaded, loaded_meta)
    n = sum(a.size for a in tensors.values())
    bpv = 8.0 * sum(a.nbytes for a in packed.values()) / n
    # codes + scales + zero points (+ the FP16 sink token of 128): nominal bits plus the sinks' share
    assert cfg.bits_per_value(22) <= bpv <= cfg.bits_per_value(22) + 16 / 128 + 1e-9
    for name, a in tensors.items():
        assert out[name].shape == a.shape and out[name].dtype == a.dtype
        s = error_stats(a, out[name])
        assert s.snr_db > (10.0 if bits == 3 else 5.0), (name, s.snr_db)
        np.testing.assert_array_equal(out[name][..., :1, :], a[..., :1, :])   # the sink token is exact


def test_layer_bits_give_each_layer_its_width():
    cfg = plan_config()
    tensors = tinyllama_cache(seq=128)
    packed, meta = compress_tensors(tensors, cfg)
    info = json.loads(meta["kvcx.tensors"])
    codecs = json.loads(meta["kvcx.codecs"])
    assert info["layer_2_key"]["codec"] == "key.b4" and info["layer_2_value"]["codec"] == "value.b4"
    assert info["layer_5_value"]["codec"] == "value" and info["layer_7_value"]["codec"] == "value.b2"
    assert info["layer_0_key"]["codec"] == "key" and codecs["key.b4"]["bits"] == 4
    recs = packed_tensors(packed, meta)
    assert recs["layer_2_key"].config["bits"] == 4 and recs["layer_0_key"].config["bits"] == 3
    # a 4-bit layer holds 4/3 the code bytes of a 3-bit one
    assert packed["layer_2_key.kvcx.codes"].size * 3 == packed["layer_0_key.kvcx.codes"].size * 4
    out = decompress_tensors(packed, meta)
    err = {n: error_stats(tensors[n], out[n]).snr_db for n in ("layer_2_key", "layer_0_key", "layer_7_value",
                                                              "layer_0_value")}
    assert err["layer_2_key"] > err["layer_0_key"] + 3 and err["layer_7_value"] < err["layer_0_value"] - 3
    # the same tensors under the uniform preset decode to the same values where the widths agree
    base = decompress_tensors(*compress_tensors(tensors, KVConfig.from_scheme("kvcx3")))
    np.testing.assert_array_equal(base["layer_0_key"], out["layer_0_key"])
    # named variants: keys in groups of 128 tokens, asymmetric 3-bit values; their own codec names
    var = plan_config(layer_bits=((9, "b3g128", "b3a"), (10, "b4g128", 4)))
    packed, meta = compress_tensors(tensors, var)
    info, codecs = json.loads(meta["kvcx.tensors"]), json.loads(meta["kvcx.codecs"])
    assert info["layer_9_key"]["codec"] == "key.b3g128" and info["layer_9_value"]["codec"] == "value.b3a"
    assert info["layer_10_key"]["codec"] == "key.b4g128" and info["layer_10_value"]["codec"] == "value.b4"
    assert codecs["key.b3g128"]["group_size"] == 128 and codecs["value.b3a"]["scheme"] == "asymmetric"
    assert codecs["value.b4"]["scheme"] == "symmetric" and codecs["value.b3a"]["sinks"] == 1
    # g128 keys: half the scale and zero-point bytes of g64 keys, the same code bytes
    assert packed["layer_9_key.kvcx.scales"].size * 2 == packed["layer_0_key.kvcx.scales"].size
    assert packed["layer_9_key.kvcx.codes"].size == packed["layer_0_key.kvcx.codes"].size
    out = decompress_tensors(*kst.load_with_metadata(kst.save(packed, meta)))
    for n in ("layer_9_key", "layer_9_value", "layer_10_key"):
        np.testing.assert_array_equal(out[n][..., :1, :], tensors[n][..., :1, :])   # the sink stays exact
    sym, asym = (error_stats(tensors[n], out[n]).snr_db for n in ("layer_0_value", "layer_9_value"))
    assert asym > sym + 1, (asym, sym)   # asymmetric 3-bit values: one more level used, a better SNR


def test_layer_bits_config_errors_and_json_round_trip():
    cfg = plan_config()
    assert KVConfig.from_config(json.loads(json.dumps(cfg.get_config()))) == cfg
    assert cfg.for_layer(5).value.bits == 3 and cfg.for_layer(5).key.bits == 4 and cfg.for_layer(0).key.bits == 3
    assert "5:4/3" in cfg.describe()
    # +1 bit (key 2), +1 (value 2), +1 (key 5), -0.75 (value 7: 2-bit asymmetric 2.5 vs 3-bit symmetric 3.25)
    assert abs(cfg.bits_per_value(22) - (22 * 3.375 + 2.25 / 2) / 22) < 1e-9
    base = KVConfig.from_scheme("kvcx3")
    for bad, msg in [([(1, 4)], "layer, key_bits, value_bits"), ([(1, 5, 3)], "not one of"),
                     ([(-1, 4, 4)], "layer -1"), ([(1, 4, 4), (1, 3, 3)], "twice"), (7, "must be a list"),
                     ([(1.5, 4, 4)], "layer 1.5"), ([(1, "b9x", 3)], "or the tag of one of the config's variants"),
                     ([(1, "b3zz", 3)], "does not define")]:
        with pytest.raises(CodecError, match=msg):
            KVConfig(key=base.key, value=base.value, layer_bits=bad, variants=base.variants)
    for bad, msg in [({"key.x": base.key}, "not a variant name"), ({"key.b4": base.key}, "codec of 4 bits"),
                     ([("value.b3",)], "must map")]:
        with pytest.raises(CodecError, match=msg):
            KVConfig(key=base.key, value=base.value, variants=bad)
    with pytest.raises(CodecError, match="variants must be an object"):
        KVConfig.from_config({**cfg.get_config(), "variants": [1]})
    for bad, msg in [({"key": {}}, "'key' and 'value'"), ({**cfg.get_config(), "extra": 1}, "unknown kvcx config"),
                     ({**cfg.get_config(), "scheme": 3}, "scheme must be a string")]:
        with pytest.raises(CodecError, match=msg):
            KVConfig.from_config(bad)


def test_allocate_spends_the_budget_where_sensitivity_is():
    preset = KVConfig.from_scheme("kvcx3")
    base = KVConfig(key=preset.key, value=preset.value, scheme="kvcx3")   # no variants: widths 3 and 4
    sens = {(k, L): 1e-4 for L in range(10) for k in ("key", "value")}
    sens[("key", 4)] = 0.05
    sens[("value", 8)] = 0.02
    plan, est, guessed = allocate(sens, base, 10, budget=3.375 + 3 / 20)   # room for exactly 3 one-bit raises
    widths = {L: (kb, vb) for L, kb, vb in plan.layer_bits}
    assert widths[4][0] == 4 and widths[8][1] == 4 and len(plan.layer_bits) == 3
    assert plan.bits_per_value(10) <= 3.375 + 3 / 20 + 1e-9
    # nothing measured above 3 bits: every 4-bit figure is the 3-bit one / 4
    assert est == pytest.approx(sum(sens.values()) - 0.75 * (0.05 + 0.02 + 1e-4)) and guessed == 3
    same, est0, _ = allocate(sens, base, 10, budget=3.375)
    assert same.layer_bits == () and est0 == pytest.approx(sum(sens.values()))
    with pytest.raises(KvcxError, match="at or above the 3.375"):
        allocate(sens, base, 10, budget=3.0)
    with pytest.raises(KvcxError, match="no sensitivity measured for values of layer 9"):
        allocate({k: v for k, v in sens.items() if k != ("value", 9)}, base, 10, budget=3.5)


def test_allocate_is_the_exact_optimum_of_the_measured_figures():
    """The knapsack against brute force over every choice of the presets' options (keys: 2, 3, 4 bits in
    groups of 64 and 3, 4 in groups of 128; values: asymmetric 2 bits, symmetric or asymmetric 3 and 4)."""
    import itertools

    base = KVConfig.from_scheme("kvcx2")
    opts = {k: base.options(k) for k in ("key", "value")}
    assert sorted(opts["key"]) == ["b2", "b3", "b3g128", "b4", "b4g128"]
    assert sorted(opts["value"]) == ["b2", "b3", "b3a", "b4", "b4a"]
    assert base.codec_at("value", 3).scheme == "symmetric" and base.codec_at("value", "b3a").scheme == "asymmetric"
    assert base.codec_at("key", "b3g128").group_size == 128 and base.codec_at("value", 2) == base.value
    cost = {(k, t): base.codec_at(k, t if not t[1:].isdigit() else int(t[1:])).bits_per_value()
            for k in opts for t in opts[k]}
    assert cost[("key", "b3g128")] == 3.25 and cost[("value", "b3")] == 3.25 and cost[("value", "b3a")] == 3.5
    rng = np.random.default_rng(7)
    n = 2
    items = [(k, L) for L in range(n) for k in ("key", "value")]
    sens = {}
    for k, L in items:   # more bits/value, less KLD, by uneven factors the 4x rule would misjudge
        a = rng.uniform(1e-4, 0.05)
        for t in opts[k]:
            sens[(k, L, t)] = a * 4.0 ** -(cost[(k, t)] - 2.5) * rng.uniform(0.3, 3.0)
    for budget in (2.5, 2.7, 3.0, 3.3, 3.6, 4.0, 4.5):
        best = min((sum(sens[(k, L, t)] for (k, L), t in zip(items, ts)), ts)
                   for ts in itertools.product(*(opts[k] for k, _ in items))
                   if sum(cost[(k, t)] for (k, _), t in zip(items, ts)) / len(items) <= budget + 1e-9)
        plan, est, guessed = allocate(sens, base, n, budget)
        assert est == pytest.approx(best[0]) and guessed == 0, budget
        got = {L: (kb, vb) for L, kb, vb in plan.layer_bits}
        chosen = [t if isinstance(t, str) else f"b{t}" for L in range(n) for t in got.get(L, (2, 2))]
        assert chosen == list(best[1]), budget
        assert plan.bits_per_value(n) <= budget + 1e-9
        for L in range(n):   # the plan's layers get the chosen codecs
            for k, t in zip(("key", "value"), chosen[2 * L:2 * L + 2]):
                assert getattr(plan.for_layer(L), k) == base.codec_at(k, t if not t[1:].isdigit() else int(t[1:]))


def test_cli_plan_files_compress_decompress_metrics(cache, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"config": plan_config().get_config(), "budget": 3.5}))
    packed_path, restored = tmp_path / "p.safetensors", tmp_path / "r.safetensors"
    r = run("compress", cache, packed_path, "--plan", plan, "--json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    assert set(m["config"]["codecs"]) >= {"key", "value", "key.b4", "value.b2"}
    assert run("decompress", packed_path, restored).exit_code == 0
    orig, back = kst.load_file(cache), kst.load_file(restored)
    assert set(orig) == set(back) and all(back[k].shape == orig[k].shape for k in orig)
    # Hugging Face's reader sees plain tensors
    safetensors = pytest.importorskip("safetensors.numpy")
    assert "layer_2_key.kvcx.codes" in safetensors.load_file(str(packed_path))
    for scheme in ("kvcx3", "kvcx2"):
        r = run("metrics", cache, "--scheme", scheme, "--json", "--min-snr", "0", "--max-rmse", "10",
                "--min-cosine", "0")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["config"]["scheme"] == scheme
    # bad plans: one red line, exit 1
    for text, msg in [(None, "no such plan file"), ("{", "not valid JSON"),
                      (json.dumps({"config": {"key": {}, "value": {}, "layer_bits": [[1, 9, 4]]}}), "not one of")]:
        p = tmp_path / "bad.json"
        if text is not None:
            p.write_text(text)
        elif p.exists():
            p.unlink()
        r = run("compress", cache, tmp_path / "x.safetensors", "--plan", p)
        assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output, r.output
    assert isinstance(load_plan(plan), KVConfig)


def test_metrics_plot_draws_the_per_head_heatmap(cache, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    png = tmp_path / "heat.png"
    r = run("metrics", cache, "--scheme", "kvcx2", "--plot", png, "--json", "--min-snr", "0", "--max-rmse", "10",
            "--min-cosine", "0")
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # --json keeps stdout machine-readable
    img = mpimg.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[0] > 100 and img.shape[1] > 200
    tensors = tinyllama_cache(seq=128)
    grids = head_snr_grid(tensors, decompress_tensors(*compress_tensors(tensors, plan_config())))
    layers, grid = grids["key"]
    assert layers == list(range(22)) and grid.shape == (22, 4) and np.isfinite(grid).all()
    # layer 2's keys are 4-bit in the plan: every head better than layer 0's 3-bit keys
    assert (grid[2] > grid[0] + 3).all()
    # names without a layer index: a clear error
    flat = tmp_path / "flat.safetensors"
    kst.save_file({"k": tensors["layer_0_key"], "v": tensors["layer_0_value"]}, flat)
    r = run("metrics", flat, "--plot", tmp_path / "x.png")
    assert r.exit_code == 1 and "layer index" in r.output
    r = run("metrics", cache, "--plot", tmp_path / "no" / "x.png")
    assert r.exit_code == 1 and "does not exist" in r.output and "Traceback" not in r.output


def test_kv_chunks_refuse_per_layer_widths():
    from kvcx.chunk import ChunkCodec

    with pytest.raises(CodecError, match="per-layer widths"):
        ChunkCodec(plan_config())


@pytest.mark.model
def test_kvcx_cache_with_presets_and_a_plan(loaded, wikitext_path):
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    from kvcx.hf import KvcxCache

    model, tok, _ = loaded
    ids = torch.tensor(tok(wikitext_path.read_text(encoding="utf-8")[:8000])["input_ids"][:300])[None]
    n_layers = model.config.num_hidden_layers
    plan = plan_config("kvcx2", layer_bits=[(L, 4, 4) for L in range(0, n_layers, 2)])
    with torch.inference_mode():
        ref = model(ids, past_key_values=DynamicCache()).logits[0, -1]
        for cfg in (KVConfig.from_scheme("kvcx3"), KVConfig.from_scheme("kvcx2"), plan):
            cache = KvcxCache(model.config, kv_config=cfg)
            model(ids[:, :256], past_key_values=cache)
            logits = model(ids[:, 256:], past_key_values=cache).logits[0, -1]
            layer0, layer1 = cache.layers[0], cache.layers[1]
            want0 = 4 if cfg is plan else cfg.key.bits
            assert layer0.store.keys.chunk(0).config["bits"] == want0
            assert layer1.store.keys.chunk(0).config["bits"] == cfg.key.bits
            assert layer0.store.keys.chunk(0).codes.nbytes * cfg.key.bits == \
                layer1.store.keys.chunk(0).codes.nbytes * want0
            cos = torch.nn.functional.cosine_similarity(ref, logits, dim=0)
            assert cos > 0.9, (cfg.describe(), float(cos))
        g = model.generate(ids[:, :200], past_key_values=KvcxCache(model.config, kv_config=plan),
                           max_new_tokens=6, do_sample=False)
        assert g.shape[1] == 206
        # the shipped plan (README): keys in groups of 128 tokens and asymmetric values with their sinks
        shipped = load_plan(PLANS / "smollm2-kvcx2-3.54.json")
        sel = {L: (kb, vb) for L, kb, vb in shipped.layer_bits}
        L = next(L for L, (kb, vb) in sel.items() if (kb, vb) == ("b3g128", "b3a"))
        cache = KvcxCache(model.config, kv_config=shipped)
        model(ids[:, :256], past_key_values=cache)
        logits = model(ids[:, 256:], past_key_values=cache).logits[0, -1]
        kc, vc = (getattr(cache.layers[L].store, k).chunk(0).config for k in ("keys", "values"))
        assert (kc["bits"], kc["group_size"], vc["bits"], vc["scheme"], vc["sinks"]) == (3, 128, 3, "asymmetric", 1)
        cos = torch.nn.functional.cosine_similarity(ref, logits, dim=0)
        assert cos > 0.95, float(cos)
        # decoding past a residual flush (64 tokens) appends chunks to the g128 keys
        g = model.generate(ids[:, :250], past_key_values=KvcxCache(model.config, kv_config=shipped),
                           max_new_tokens=80, do_sample=False)
    assert g.shape[1] == 330


@pytest.mark.model
def test_calibrate_measures_every_layer_and_writes_a_plan(loaded, wikitext_path, tmp_path):
    from kvcx import calibrate as cal
    from kvcx.api import save_plan

    res = cal.run_calibration(KVConfig.from_scheme("kvcx2"), budget=2.7, dataset_file=wikitext_path, windows=1,
                              offset=3, window=192, stride=64, loaded=loaded, options=["b2", "b3", "b4"])
    n = res.n_layers
    assert set(res.sensitivity) == {(k, L, t) for L in range(n) for k in ("key", "value") for t in ("b2", "b3", "b4")}
    assert all(v >= 0 for v in res.sensitivity.values()) and max(res.sensitivity.values()) > 0
    assert res.tokens == 63 and res.bits_per_value <= 2.7 + 1e-9 and res.config.layer_bits
    # more bits, less damage: summed over layers, each width measurably better than the one below
    total = {t: sum(v for (k, L, w), v in res.sensitivity.items() if w == t) for t in ("b2", "b3", "b4")}
    assert total["b2"] > total["b3"] > total["b4"] > 0, total
    # the most sensitive (kind, layer) at 2 bits got more
    top = max(res.base_sensitivity(), key=res.base_sensitivity().get)
    got = {L: tuple(s if isinstance(s, str) else f"b{s}" for s in sel) for L, *sel in res.config.layer_bits}
    assert got[top[1]][0 if top[0] == "key" else 1] != "b2"
    path = tmp_path / "plan.json"
    save_plan(path, res)
    assert load_plan(path) == res.config
    assert json.loads(path.read_text())["sensitivity"][0].keys() == {"kind", "layer", "option", "kld"}
    # the plan's estimate: measured figures where it chose a measured option, 4x per bit/value from them elsewhere
    chosen = [(k, L, got.get(L, ("b2", "b2"))[i]) for L in range(n) for i, k in enumerate(("key", "value"))]
    assert res.extrapolated == sum(c not in res.sensitivity for c in chosen)
    if res.extrapolated == 0:
        assert res.estimated_kld == pytest.approx(sum(res.sensitivity[c] for c in chosen))
    # one kind's options alone: the figures are kept (no plan yet) and --reuse combines them with the rest
    part = cal.run_calibration(KVConfig.from_scheme("kvcx2"), budget=2.7, dataset_file=wikitext_path, windows=1,
                               offset=3, window=192, stride=64, loaded=loaded, options=["value.b3a"])
    assert not part.complete and set(part.sensitivity) == {("value", L, "b3a") for L in range(n)}
    assert part.config.layer_bits == () and part.to_dict()["estimated_kld"] is None
    both = cal.reallocate([res.to_dict(), part.to_dict()], 3.0)
    assert {t for _, _, t in both.sensitivity} == {"b2", "b3", "b4", "b3a"}
    assert all(both.sensitivity[("value", L, "b3a")] == part.sensitivity[("value", L, "b3a")] for L in range(n))
    with pytest.raises(KvcxError, match="not a --plan"):
        cal.run_calibration(res.config, budget=3.0, dataset_file=wikitext_path, loaded=loaded)


def test_calibrate_reuse_reallocates_without_a_model(tmp_path):
    from kvcx.calibrate import reallocate

    base = KVConfig.from_scheme("kvcx2")
    sens = [{"kind": k, "layer": L, "kld": (0.05 if (k, L) == ("key", 3) else 1e-4)} for L in range(6)
            for k in ("key", "value")]
    saved = {"config": base.get_config(), "sensitivity": sens, "n_layers": 6, "windows": 4, "tokens": 2044}
    src = tmp_path / "measured.json"
    src.write_text(json.dumps(saved))
    out = tmp_path / "plan.json"
    r = run("calibrate", "--reuse", src, "--budget", 2.5 + 2 / 12, "--out", out)
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.layer_bits[0] == (3, 4, 2) and plan.bits_per_value(6) <= 2.5 + 2 / 12 + 1e-9
    again = reallocate(json.loads(out.read_text()), 2.5 + 2 / 12)
    assert again.config == plan     # a plan file is itself a source: its base config has no layer widths
    assert reallocate(saved, 3.5).config.bits_per_value(6) == pytest.approx(3.5, abs=1 / 12)
    for bad, msg in [({"config": base.get_config()}, "not a plan written"),
                     ({**saved, "n_layers": 7}, "do not cover")]:
        src.write_text(json.dumps(bad))
        r = run("calibrate", "--reuse", src, "--budget", 3, "--out", out)
        assert r.exit_code == 1 and msg in r.output, r.output
    # widths measured apart combine: 2-bit figures of a kvcx2 run, 3-bit ones of a kvcx3 run (plans of the
    # previous release: rows without "bits", no ladder in the config), on the kvcx2 ladder
    three = {"config": KVConfig.from_scheme("kvcx3").get_config(), "n_layers": 6, "windows": 4, "tokens": 2044,
             "sensitivity": [{"kind": k, "layer": L, "kld": (0.04 if (k, L) == ("key", 3) else 1e-6)}
                             for L in range(6) for k in ("key", "value")]}
    src.write_text(json.dumps(saved))
    src3 = tmp_path / "measured3.json"
    src3.write_text(json.dumps(three))
    r = run("calibrate", "--reuse", src, "--reuse", src3, "--scheme", "kvcx2", "--budget", 3.0, "--out", out,
            "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert {(s["kind"], s["layer"], s["option"]) for s in got["sensitivity"]} == \
        {(k, L, t) for L in range(6) for k in ("key", "value") for t in ("b2", "b3")}
    merged = load_plan(out)
    sel = {L: (kb, vb) for L, kb, vb in merged.layer_bits}
    assert got["extrapolated"] == sum(s not in (2, 3) for L in range(6) for s in sel.get(L, (2, 2)))
    assert merged.for_layer(3).key.bits == 4          # 0.05 at 2 bits and still 0.04 at 3: worth a fourth bit
    assert merged.codec_at("value", 3).scheme == "symmetric"
    three["tokens"] = 1000
    src3.write_text(json.dumps(three))
    r = run("calibrate", "--reuse", src, "--reuse", src3, "--budget", 3.0, "--out", out)
    assert r.exit_code == 1 and "measured on another model or text" in r.output, r.output
    r = run("calibrate", "--scheme", "kvcx2", "--options", "3,8", "--budget", 3.0, "--out", out)
    assert r.exit_code == 1 and "chooses keys from b2,b3,b3g128,b4,b4g128" in r.output, r.output
    r = run("calibrate", "--reuse", tmp_path / "missing.json", "--budget", 3, "--out", out)
    assert r.exit_code == 1 and "no such plan file" in r.output
    # a budget below the scheme's own bits fails before any model is loaded
    r = run("calibrate", "--scheme", "kvcx3", "--budget", 2.0, "--out", out)
    assert r.exit_code == 1 and "at or above the 2.500" in r.output, r.output


# ---------------------------------------------------------------------------------------------------------------
# per-channel widths (WidthCodec, --scheme kvcx2w)
# ---------------------------------------------------------------------------------------------------------------

def keys_like(shape, seed=0, dtype=np.float32):
    """Key-like data: every channel its own offset and spread (some nearly flat)."""
    rng = np.random.default_rng(seed)
    D = shape[-1]
    return (rng.standard_normal(shape) * rng.uniform(0.01, 4, D) + rng.uniform(-3, 3, D)).astype(dtype)


@pytest.mark.parametrize("shape,bits,gs,sinks,dtype", [
    ((1, 3, 200, 64), 2.0, 32, 1, np.float32), ((2, 2, 100, 32), 3.5, 16, 2, np.float16),
    ((1, 1, 300, 64), 1.0, 128, 0, np.float32), ((4, 40, 16), 8, 32, 3, np.float32),
    ((1, 2, 70, 24), 2.5, 16, 1, np.float16)])
def test_widths_codec_matches_the_numpy_reference(shape, bits, gs, sinks, dtype):
    from kvcx.codec import WidthCodec, decode_packed
    from reference import widths_encode

    x = keys_like(shape, dtype=dtype)
    c = WidthCodec(bits=bits, group_size=gs, sinks=sinks)
    p = c.encode(x, "k")
    codes, scales, dec = widths_encode(x, bits, gs, sinks)
    assert np.array_equal(p.codes, codes) and np.array_equal(p.scales, scales)
    y = decode_packed(p)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, dec.astype(dtype))
    if sinks:
        np.testing.assert_array_equal(y[..., :sinks, :], x[..., :sinks, :])
    N = int(np.prod(shape[:-2]))
    widths = p.codes[:N * shape[-1]].reshape(N, -1)
    assert widths.sum() == round(bits * shape[-1]) * N and widths.max() <= 8
    # the buffers of an earlier Packed are reused
    q = c.encode(keys_like(shape, seed=1, dtype=dtype), "k")
    assert c.encode(x, "k", out=q) is q and np.array_equal(q.codes, p.codes)


def test_widths_follow_the_spread_and_the_weights():
    from kvcx.codec import WidthCodec, decode_packed

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 256, 64)).astype(np.float32)
    x[..., :8] *= 20        # wide channels
    x[..., 8:16] *= 0.01    # flat channels
    c = WidthCodec(bits=2.0, group_size=32, sinks=1)
    w = c.encode(x).codes[:128].reshape(2, 64)
    assert w[:, :8].min() > w[:, 16:].mean() > 1 and w[:, 8:16].max() == 0
    # the queries weigh channels 32-63 of head 0 a thousand times more: they get the bits, and their error falls
    weights = np.ones((2, 64))
    weights[0, 32:] = 1000.0
    pw = c.encode(x, weights=weights)
    ww = pw.codes[:128].reshape(2, 64)
    assert ww[0, 32:].mean() > w[0, 32:].mean() + 1
    err = lambda p: np.abs(decode_packed(p) - x)[0, 0, 1:, 32:].mean()
    assert err(pw) < 0.6 * err(c.encode(x))
    # the heads share the tensor's budget: the weighted head takes bits from the other
    assert ww[0].sum() > ww[1].sum() and ww.sum() == w.sum() == 2 * 128


def test_widths_codec_errors():
    from kvcx.codec import Packed, WidthCodec, decode_packed

    with pytest.raises(CodecError, match="mean bits"):
        WidthCodec(bits=0)
    with pytest.raises(CodecError, match="mean bits"):
        WidthCodec(bits=9)
    with pytest.raises(CodecError, match="group size"):
        WidthCodec(group_size=24)
    c = WidthCodec(bits=2.01, group_size=32)
    with pytest.raises(CodecError, match="'k'.*not a whole number of bits"):
        c.encode(np.zeros((1, 1, 64, 64), np.float32), "k")
    c = WidthCodec(bits=2.0, group_size=32, sinks=1)
    with pytest.raises(CodecError, match="multiple of 8"):
        c.encode(np.zeros((1, 1, 64, 12), np.float32), "k")
    with pytest.raises(CodecError, match="at least 2 dims"):
        c.encode(np.zeros(64, np.float32), "k")
    with pytest.raises(CodecError, match="empty"):
        c.encode(np.zeros((1, 0, 64), np.float32), "k")
    x = keys_like((1, 2, 100, 64))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[0, 1, 50, 7] = bad
        with pytest.raises(CodecError, match="'k' contains 1 NaN/Inf"):
            c.encode(y, "k")
    y = x.copy()
    y[0, 0, 0, 0] = np.nan    # a sink token
    with pytest.raises(CodecError, match="NaN/Inf"):
        c.encode(y, "k")
    with pytest.raises(CodecError, match="FP16"):
        c.encode(x * 1e5, "k")
    for w in (np.ones((3, 64)), np.ones((2, 32)), -np.ones((2, 64)), np.full((2, 64), np.nan)):
        with pytest.raises(CodecError, match="key weights"):
            c.encode(x, "k", weights=w)
    with pytest.raises(CodecError, match="out must be a Packed"):
        c.encode(x, "k", out=c.encode(keys_like((1, 2, 90, 64)), "k"))
    with pytest.raises(CodecError, match="'k'.*one width"):   # the one-width codec takes no channel weights
        IntCodec().encode(x, "k", weights=np.ones((2, 64)))
    # damaged data: widths that do not add up, a range that ends below its start, NaN ranges, short codes
    p = c.encode(x, "k")
    N, D, G = 2, 64, -(-99 // 32)

    def damaged(**kw):
        q = Packed(**{**p.__dict__, "codes": p.codes.copy(), "scales": p.scales.copy()})
        for k, v in kw.items():
            setattr(q, k, v)
        return q
    codes = p.codes.copy()
    codes[0] += 1
    with pytest.raises(CodecError, match="'k'.*widths.*damaged"):
        decode_packed(damaged(codes=codes), name="k")
    codes = p.codes.copy()
    st = codes[N * D:N * D + N * G * D * 2].reshape(N, G, D, 2)
    st[0, 1, 5] = (200, 100)
    with pytest.raises(CodecError, match="'k'.*damaged"):
        decode_packed(damaged(codes=codes), name="k")
    scales = p.scales.copy()
    scales[0, 3, 0] = np.nan
    with pytest.raises(CodecError, match="'k'.*channel ranges"):
        decode_packed(damaged(scales=scales), name="k")
    with pytest.raises(CodecError, match="'k'.*expected"):
        decode_packed(damaged(codes=p.codes[:-1]), name="k")


def test_kvcx2w_preset_and_weights_round_trip_through_the_file_format(tmp_path):
    from kvcx.codec import WidthCodec
    from kvcx.errors import FormatError
    from kvcx.packed import read_settings

    cfg = KVConfig.from_scheme("kvcx2w")
    assert isinstance(cfg.key, WidthCodec) and (cfg.key.bits, cfg.key.group_size, cfg.key.sinks) == (2.0, 32, 1)
    assert cfg.value == KVConfig.from_scheme("kvcx2").value
    assert cfg.bits_per_value(22) == 2.5
    tensors = {k: keys_like(a.shape, seed=i) if k.endswith("key") else a
               for i, (k, a) in enumerate(tinyllama_cache(seq=512).items())}
    weights = {str(L): (np.random.default_rng(L).uniform(0, 5, (4, 64))).tolist() for L in range(22)}
    wcfg = KVConfig.from_config({**cfg.get_config(), "key_weights": weights})
    assert KVConfig.from_config(wcfg.get_config()) == wcfg and "query-weighted" in wcfg.describe()
    for c in (cfg, wcfg):
        packed, meta = compress_tensors(tensors, c)
        assert meta["kvcx.format_version"] == "3"
        out = decompress_tensors(*kst.load_with_metadata(kst.save(packed, meta)))
        for name, a in tensors.items():
            assert out[name].dtype == a.dtype and out[name].shape == a.shape
            assert error_stats(a, out[name]).snr_db > (9 if name.endswith("key") else 6), name
        bpv = 8.0 * sum(a.nbytes for a in packed.values()) / sum(a.size for a in tensors.values())
        assert 2.5 < bpv < 2.6, bpv   # 2.5 nominal + sinks, channel ranges and widths of 512 tokens
    # the weights choose the widths: the weighted file differs in its key codes only
    p1, _ = compress_tensors(tensors, cfg)
    p2, _ = compress_tensors(tensors, wcfg)
    assert not np.array_equal(p1["layer_3_key.kvcx.codes"], p2["layer_3_key.kvcx.codes"])
    assert np.array_equal(p1["layer_3_value.kvcx.codes"], p2["layer_3_value.kvcx.codes"])
    # the CLI takes the preset; a version-2 file that names the widths codec is refused
    src = tmp_path / "c.safetensors"
    kst.save_file(tensors, src)
    r = run("compress", str(src), str(tmp_path / "p.safetensors"), "--scheme", "kvcx2w")
    assert r.exit_code == 0, r.output
    r = run("decompress", str(tmp_path / "p.safetensors"), str(tmp_path / "d.safetensors"))
    assert r.exit_code == 0, r.output
    packed, meta = compress_tensors(tensors, cfg)
    meta = {**meta, "kvcx.format_version": "2"}
    with pytest.raises(FormatError, match="needs format version 3"):
        read_settings(meta, "old.safetensors")
    # settings that do not go together
    with pytest.raises(CodecError, match="sets its own bits"):
        KVConfig.from_scheme("kvcx2w", bits=3)
    with pytest.raises(CodecError, match="key_weights.*widths key codec"):
        KVConfig.from_config({**KVConfig.from_scheme("kvcx2").get_config(), "key_weights": weights})
    with pytest.raises(CodecError, match="layer 1 must list"):
        KVConfig.from_config({**cfg.get_config(), "key_weights": {"1": [[1.0, -2.0]]}})
    with pytest.raises(CodecError, match="no per-layer bits"):
        KVConfig(key=cfg.key, value=cfg.value, layer_bits=[(0, 4, 4)])
    from kvcx.chunk import ChunkCodec

    with pytest.raises(CodecError, match="kvcx2w.*not supported"):
        ChunkCodec(cfg)


def test_calibrate_reuse_of_a_width_plan_changes_the_keys_mean(tmp_path):
    from kvcx.calibrate import reallocate

    saved = json.loads((PLANS / "smollm2-kvcx2w-2.47.json").read_text())
    cfg = load_plan(PLANS / "smollm2-kvcx2w-2.47.json")
    assert cfg.key.bits == 1.9375 and len(cfg.key_weights) == 30
    res = reallocate(saved, 2.5)
    assert res.config.key.bits == 2.0 and res.config.key_weights == cfg.key_weights
    with pytest.raises(KvcxError, match="--budget 1.0"):
        reallocate(saved, 1.0)


@pytest.mark.model
def test_kvcx2w_in_kvcx_cache_and_calibrated_query_weights(loaded, wikitext_path, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    from kvcx import calibrate as cal
    from kvcx.api import save_plan
    from kvcx.codec import WidthCodec
    from kvcx.hf import KvcxCache

    model, tok, _ = loaded
    n = model.config.num_hidden_layers
    res = cal.run_calibration(KVConfig.from_scheme("kvcx2w"), budget=2.5, dataset_file=wikitext_path, windows=1,
                              offset=3, window=192, stride=64, loaded=loaded)
    plan = res.config
    assert isinstance(plan.key, WidthCodec) and plan.key.bits == 2.0 and len(plan.key_weights) == n
    w = np.asarray(plan.key_weights[0][1])
    assert w.shape == (model.config.num_key_value_heads, 64) and (w > 0).all()
    np.testing.assert_allclose(w[:, :32], w[:, 32:], rtol=1e-5)   # the rotary pairs share a weight
    save_plan(tmp_path / "w.json", res)
    assert load_plan(tmp_path / "w.json") == plan
    ids = torch.tensor(tok(wikitext_path.read_text(encoding="utf-8")[:8000])["input_ids"][:300])[None]
    with torch.inference_mode():
        ref = model(ids, past_key_values=DynamicCache()).logits[0, -1]
        for cfg in (KVConfig.from_scheme("kvcx2w"), plan):
            cache = KvcxCache(model.config, kv_config=cfg)
            model(ids[:, :256], past_key_values=cache)
            logits = model(ids[:, 256:], past_key_values=cache).logits[0, -1]
            chunk = cache.layers[1].store.keys.chunk(0)
            assert chunk.config["id"] == "kvcx.widths" and cache.memory_report()["attention_steps"]["fused"] == 0
            cos = torch.nn.functional.cosine_similarity(ref, logits, dim=0)
            assert cos > 0.9, (cfg.describe(), float(cos))
        # generation past a residual flush appends chunks of keys whose widths each chunk chooses
        g = model.generate(ids[:, :250], past_key_values=KvcxCache(model.config, kv_config=plan),
                           max_new_tokens=80, do_sample=False)
    assert g.shape[1] == 330
