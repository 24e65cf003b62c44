"""Validation on the real embedded model (SmolLM2-135M GGUF): utilities, identity codec, end to end."""
import json
import math

import pytest

from kvcx.codecs import KVConfig
from kvcx.errors import KvcxError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from kvcx.cli import app  # noqa: E402
from kvcx.quality import bridge as kvc  # noqa: E402
from kvcx.quality.validation import identity_roundtrip, run_validation  # noqa: E402

pytestmark = pytest.mark.model


PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def test_extract_validate_stats_save_load(loaded, tmp_path):
    model, tok, name = loaded
    cache, meta = kvc.extract_kv_cache(model, tok, PROMPT)
    assert (meta.num_layers, meta.num_kv_heads, meta.head_dim) == (30, 3, 64)
    assert meta.seq_len == len(tok(PROMPT)["input_ids"])
    # the decoder alone (no logits) gives the cache a whole forward pass gives
    with torch.no_grad():
        whole = model(tok(PROMPT, return_tensors="pt")["input_ids"], use_cache=True).past_key_values
    assert all(torch.equal(a, c) and torch.equal(b, d)
               for (a, b), (c, d) in zip(kvc.cache_layers(cache), kvc.cache_layers(whole)))
    kvc.validate_kv_cache_shape(cache, model.config)
    with pytest.raises(KvcxError, match="KV cache has 30 layers, the model has 22"):
        kvc.validate_kv_cache_shape(cache)  # TinyLlama's constants by default
    stats = kvc.compute_kv_cache_stats(cache)
    assert stats["num_values"] == 2 * 30 * 3 * meta.seq_len * 64 and stats["key"]["abs_max"] > 0
    path = tmp_path / "cache.safetensors"
    kvc.save_kv_cache(cache, path, meta)
    side = json.loads((tmp_path / "cache.safetensors.metadata.json").read_text())
    assert side["num_layers"] == 30 and side["seq_len"] == meta.seq_len
    back, meta2 = kvc.load_kv_cache(path)
    for (k1, v1), (k2, v2) in zip(kvc.cache_layers(cache), kvc.cache_layers(back)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # bfloat16 caches are kept exactly (not widened)
    bf = kvc.make_dynamic_cache([(k.bfloat16(), v.bfloat16()) for k, v in kvc.cache_layers(cache)])
    kvc.save_kv_cache(bf, tmp_path / "bf.safetensors")
    back_bf, meta_bf = kvc.load_kv_cache(tmp_path / "bf.safetensors")
    assert meta_bf.dtype == "bfloat16"
    assert all(torch.equal(a[0], b[0]) for a, b in zip(kvc.cache_layers(bf), kvc.cache_layers(back_bf)))


def test_extract_rejects_bad_prompts(loaded):
    model, tok, _ = loaded
    with pytest.raises(KvcxError, match="batch size 1"):
        kvc.extract_kv_cache(model, tok, ["a", "b"])
    with pytest.raises(KvcxError, match="0 tokens"):
        kvc.extract_kv_cache(model, tok, "")


def test_compressed_cache_file_serves_the_model(loaded, tmp_path):
    """compress -> packed file -> load_kv_cache: the model continues from the decoded cache."""
    from kvcx.api import compress_kv_cache

    model, tok, _ = loaded
    cache, meta = kvc.extract_kv_cache(model, tok, PROMPT)
    kvc.save_kv_cache(cache, tmp_path / "c.safetensors", meta)
    m = compress_kv_cache(tmp_path / "c.safetensors", tmp_path / "p.safetensors")
    assert m.passed and m.compression_ratio > 3 and m.file_size_ratio > 6  # vs FP16; the file holds FP32
    packed_cache, _ = kvc.load_kv_cache(tmp_path / "p.safetensors")
    nxt = tok(" Then", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a = model(nxt, past_key_values=cache).logits[0, -1]
        b = model(nxt, past_key_values=packed_cache).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


def test_identity_codec_gives_zero_delta(loaded, wikitext_path):
    r = run_validation(KVConfig.from_scheme(), dataset_file=wikitext_path, max_windows=2, loaded=loaded,
                       roundtrip=identity_roundtrip)
    assert r.delta == 0.0 and r.baseline_perplexity == r.compressed_perplexity
    assert r.tokens_scored == 2 * 511
    assert r.kld == 0.0 and r.top1_agreement == 1.0  # the same logits: no divergence at all


def test_validate_default_scheme(loaded, wikitext_path):
    r = run_validation(KVConfig.from_scheme(), threshold=0.5, dataset_file=wikitext_path, max_windows=3,
                       loaded=loaded)
    assert 5 < r.baseline_perplexity < 60 and math.isfinite(r.compressed_perplexity)
    assert r.compressed_perplexity != r.baseline_perplexity  # the codec really ran
    assert abs(r.delta) < 0.5 and r.passed
    assert 0.0 < r.kld < 0.1 and 0.9 < r.top1_agreement < 1.0  # sensitive measures, same scored tokens
    assert 3.3 < r.compression_ratio < 4 and r.snr_db > 18  # vs FP16
    assert r.cache_dtype == "float32" and r.compression_ratio_vs_cache_dtype == pytest.approx(2 * r.compression_ratio)
    ref = run_validation(KVConfig.from_scheme("reference"), dataset_file=wikitext_path, max_windows=3, loaded=loaded)
    assert ref.baseline_perplexity == r.baseline_perplexity
    assert ref.delta > r.delta  # the default beats the reference design
    assert ref.kld > r.kld and ref.top1_agreement <= r.top1_agreement


def test_cli_validate_end_to_end_json(wikitext_path):
    r = CliRunner().invoke(app, ["validate", "--threshold", "0.3", "--max-windows", "2", "--cpu", "--json",
                                 "--dataset-file", str(wikitext_path)])
    assert r.exit_code in (0, 3), r.output
    v = json.loads(r.stdout)
    assert v["windows"] == 2 and v["threshold"] == 0.3 and v["passed"] == (v["delta"] < 0.3)
    # the ratio is against FP16 (bits/value beside it); the FP32 figure only under its own label
    assert 3.3 < v["compression_ratio"] < 4.0
    assert v["kld"] > 0 and 0 < v["top1_agreement"] <= 1
    assert v["compression_ratio"] == pytest.approx(16 / v["bits_per_value"])
    assert v["cache_dtype"] == "float32" and v["compression_ratio_vs_cache_dtype"] > 6
    assert r.exit_code == (0 if v["passed"] else 3)


def test_cli_unknown_model(wikitext_path, tmp_path):
    r = CliRunner().invoke(app, ["validate", "--model", str(tmp_path / "nope.gguf"), "--dataset-file",
                                 str(wikitext_path)])
    assert r.exit_code == 1 and "no such GGUF file" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["validate", "--model", str(tmp_path), "--dataset-file", str(wikitext_path)])
    assert r.exit_code == 1 and "cannot load model" in r.output, r.output


def test_generation_mode_runs_through_kvcx_cache(loaded, wikitext_path):
    r = run_validation(KVConfig.from_scheme(), dataset_file=wikitext_path, max_windows=1, loaded=loaded,
                       mode="generation")
    assert r.mode == "generation" and r.tokens_scored == 511
    assert 0.0 < r.kld < 0.5 and 0.8 < r.top1_agreement <= 1.0
    assert math.isfinite(r.compressed_perplexity) and r.compressed_perplexity != r.baseline_perplexity
    assert abs(r.delta) < 1.0
    assert r.compression_ratio > 2.5  # FP16-equivalent bytes / packed + FP32 residual bytes


def test_several_settings_share_one_pass_and_match_single_runs(loaded, wikitext_path):
    """kvcx, llama.cpp q4_0 (with and without its rotation) and vLLM fp8 on the same windows and tokens:
    each setting's figures equal its own single run's, and the baseline is scored once for all."""
    from kvcx.quality.validation import run_validations

    names = ["kvcx", "q4_0", "q4_0-rot", "fp8_e4m3"]
    many = run_validations({n: KVConfig.from_scheme(n) for n in names}, dataset_file=wikitext_path, window=512,
                           stride=256, max_windows=2, loaded=loaded)
    assert [r.setting for r in many] == names
    assert len({r.baseline_perplexity for r in many}) == 1 and len({r.tokens_scored for r in many}) == 1
    for r in many:
        alone = run_validation(KVConfig.from_scheme(r.setting), dataset_file=wikitext_path, window=512, stride=256,
                               max_windows=2, loaded=loaded)
        assert (alone.compressed_perplexity, alone.kld, alone.bits_per_value) == \
            (r.compressed_perplexity, r.kld, r.bits_per_value)
    by = {r.setting: r for r in many}
    assert by["fp8_e4m3"].bits_per_value == pytest.approx(8.0, abs=0.05)
    assert by["q4_0"].bits_per_value == pytest.approx(4.5, abs=0.05)
    assert by["fp8_e4m3"].kld < by["q4_0"].kld        # 8 bits lose less than 4.5
    assert by["q4_0-rot"].kld < by["q4_0"].kld        # the rotation is why llama.cpp added it


def test_cli_validate_several_settings_gate_and_pareto(wikitext_path, tmp_path):
    args = ["validate", "--scheme", "kvcx,q4_0", "--window", "512", "--stride", "256", "--max-windows", "1",
            "--dataset-file", str(wikitext_path)]
    r = CliRunner().invoke(app, args + ["--json", "--threshold", "10"])
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)
    assert [x["setting"] for x in v] == ["kvcx", "q4_0"] and v[1]["config"]["key"]["id"] == "llama.cpp"
    # one setting over the threshold: exit 3 when it is gated, 0 when only the others are
    cut = (v[0]["delta"] + v[1]["delta"]) / 2 if v[0]["delta"] < v[1]["delta"] else None
    assert cut is not None and cut > 0, v
    png = tmp_path / "pareto.png"
    r = CliRunner().invoke(app, args + ["--threshold", str(cut), "--pareto", str(png)])
    assert r.exit_code == 3 and "FAILED: q4_0" in r.output and png.read_bytes()[:4] == b"\x89PNG"
    r = CliRunner().invoke(app, args + ["--threshold", str(cut), "--gate", "kvcx", "--quiet"])
    assert r.exit_code == 0 and "PASSED" in r.output, r.output
    r = CliRunner().invoke(app, args + ["--gate", "q8_0"])
    assert r.exit_code == 1 and "--gate q8_0: q8_0 is not a validated setting" in r.output, r.output
    r = CliRunner().invoke(app, args[:2] + ["kvcx,kvcx"])
    assert r.exit_code == 1 and "--scheme kvcx,kvcx: name each setting once" in r.output, r.output


def test_engine_mode_writes_every_token_through_the_codec(loaded, wikitext_path):
    """--mode engine: the scored tokens' own keys and values go through the codec too: q8_0 moves the model
    less than q4_0, and q4_0 moves it more than in prefix mode (where only the context is compressed)."""
    from kvcx.quality.validation import run_validations

    rs = run_validations({n: KVConfig.from_scheme(n) for n in ("q8_0", "q4_0")}, dataset_file=wikitext_path,
                         window=256, stride=128, max_windows=1, loaded=loaded, mode="engine")
    q8, q4 = rs
    assert q8.mode == "engine" and q8.tokens_scored == 127 and q8.baseline_perplexity == q4.baseline_perplexity
    assert 0 < q8.kld < q4.kld and q8.bits_per_value == pytest.approx(8.5) and q4.bits_per_value == pytest.approx(4.5)
    prefix = run_validation(KVConfig.from_scheme("q4_0"), dataset_file=wikitext_path, window=256, stride=128,
                            max_windows=1, loaded=loaded)
    assert q4.kld > prefix.kld      # the scored tokens' own keys and values are quantized too


@pytest.mark.model
def test_validate_on_the_device_backend_equals_the_cpu_kernels(loaded, wikitext_path):
    """--backend triton compresses and decodes the cache with the Triton kernels where the model's cache is (in
    Triton's interpreter here, on a GPU there): the same bytes as the CPU kernels, so the same perplexity, KL
    divergence and error figures; each result says which kernels ran. Settings the Triton backend cannot run
    are refused by name."""
    torch = pytest.importorskip("torch")
    from kvcx.quality.validation import run_validations

    kw = dict(dataset_file=wikitext_path, window=64, stride=32, max_windows=1, loaded=loaded)
    cfg = {"kvcx": KVConfig.from_scheme()}
    dev, cpu = run_validations(cfg, backend="triton", **kw)[0], run_validations(cfg, backend="cpu", **kw)[0]
    assert (dev.backend, cpu.backend) == ("triton", "cpu")
    assert dev.compressed_perplexity == cpu.compressed_perplexity and dev.kld == cpu.kld
    assert dev.top1_agreement == cpu.top1_agreement
    assert dev.rmse == pytest.approx(cpu.rmse, rel=1e-9) and dev.max_error == cpu.max_error
    # the device counts the packed records, the CPU the packed file (the records and its header)
    assert dev.bits_per_value < cpu.bits_per_value < dev.bits_per_value + 1.0   # 32-token contexts: a large header
    # by device: CPU here (the default), Triton on CUDA
    assert run_validations(cfg, **kw)[0].backend == ("triton" if torch.cuda.is_available() else "cpu")
    with pytest.raises(KvcxError, match="runs 4-bit integer, E8P and widths codecs.*3-bit"):
        run_validations({"kvcx3": KVConfig.from_scheme("kvcx3")}, backend="triton", **kw)
    # kvcx2v: widths keys and E8P values, both on the device (its 2-bit fallback is for head dims E8P cannot take:
    # not this model's 64), the same bytes
    two = {"kvcx2v": KVConfig.from_scheme("kvcx2v")}
    dev, cpu = run_validations(two, backend="triton", **kw)[0], run_validations(two, backend="cpu", **kw)[0]
    assert (dev.backend, cpu.backend) == ("triton", "cpu")
    assert dev.compressed_perplexity == cpu.compressed_perplexity and dev.kld == cpu.kld
    assert dev.top1_agreement == cpu.top1_agreement and dev.max_error == cpu.max_error


def test_perplexity_with_presses_prefix_and_generation(loaded, wikitext_path):
    """A press composes with a codec in perplexity too: keeping every token changes nothing; keeping half costs perplexity and halves the bytes, counted whole (kept codes + a uint16 position per
    kept token and KV head, against the whole context); generation mode prunes the prompt inside KvcxCache."""
    from kvcx.api import validation_settings
    from kvcx.quality.validation import run_validations

    configs, _ = validation_settings("kvcx,kvcx+snapkv:1.0,knorm:0.5,kvcx+knorm:0.5")
    kw = dict(dataset_file=wikitext_path, window=512, stride=256, max_windows=2, loaded=loaded)
    by = {r.setting: r for r in run_validations(configs, **kw)}
    full, everything = by["kvcx"], by["kvcx+snapkv:1.0"]
    assert (everything.compressed_perplexity, everything.kld) == (full.compressed_perplexity, full.kld)
    head_dim = loaded[0].config.head_dim
    assert everything.bits_per_value == full.bits_per_value      # every token kept: no positions to store
    assert by["knorm:0.5"].bits_per_value == pytest.approx(8.0 + 8 / (2 * head_dim), abs=1e-9)
    assert by["knorm:0.5"].kld > full.kld and by["kvcx+knorm:0.5"].kld >= by["knorm:0.5"].kld * 0.8
    assert by["kvcx+knorm:0.5"].bits_per_value < full.bits_per_value / 2 + 0.2
    gen = {r.setting: r for r in run_validations({k: configs[k] for k in ("kvcx", "kvcx+knorm:0.5")},
                                                 mode="generation", **kw)}
    assert gen["kvcx+knorm:0.5"].tokens_scored == gen["kvcx"].tokens_scored == 2 * 255
    # (bytes here are the caches' whole: a pressed cache runs the fused kernel, whose fixed workspace of a few MB
    # outweighs half of a 256-token context; test_press_cache.py compares the packed bytes)
    assert 0 < gen["kvcx+knorm:0.5"].bits_per_value < 16
    assert gen["kvcx+knorm:0.5"].kld > gen["kvcx"].kld and math.isfinite(gen["kvcx+knorm:0.5"].compressed_perplexity)
    assert loaded[0].config._attn_implementation != "kvcx"    # the run's attention setting was restored


def test_keys_before_rope_in_the_gate(loaded, wikitext_path, monkeypatch):
    """--keys-before-rope: kvcx's keys coded in the frame before the model's RoPE and turned back after decoding, in
    prefix mode (the context's cache through the packed file) and engine mode (each chunk at its own positions);
    generation mode (KvcxCache) and peers refuse it by name."""
    import functools

    from kvcx.codecs import IntCodec, WidthCodec
    from kvcx.quality import scoring, validation
    from kvcx.quality.validation import run_validations

    kw = dict(dataset_file=wikitext_path, window=256, stride=128, max_windows=1, loaded=loaded)
    post = KVConfig.from_scheme("kvcx2v")
    a, b = run_validations({"post": post, "pre": post.with_key_rope("model")}, **kw)
    assert a.baseline_perplexity == b.baseline_perplexity and a.compressed_perplexity != b.compressed_perplexity
    assert b.bits_per_value == pytest.approx(a.bits_per_value, abs=0.05) and b.kld < 2 * a.kld
    # engine mode in chunks of 64 tokens: 8-bit keys before RoPE move the model as little as after RoPE, which a
    # chunk turned at the wrong positions would not
    monkeypatch.setattr(validation, "forward_hidden", functools.partial(scoring.forward_hidden, chunk=64))
    eight = KVConfig(key=WidthCodec(bits=8, group_size=32), value=IntCodec(bits=8, group_size=64), scheme="eight")
    e_post, e_pre = run_validations({"post": eight, "pre": eight.with_key_rope("model")}, mode="engine", **kw)
    assert e_pre.mode == "engine" and 0 < e_pre.kld < 2 * e_post.kld + 1e-5, (e_pre.kld, e_post.kld)
    with pytest.raises(KvcxError, match="codes keys before RoPE, which KvcxCache.*--mode prefix or --mode engine"):
        run_validations({"pre": post.with_key_rope("model")}, mode="generation", **kw)
    r = CliRunner().invoke(app, ["validate", "--scheme", "kvcx2v,quanto-int4", "--keys-before-rope", "--max-windows", "1"])
    assert r.exit_code == 1 and "'quanto-int4' is another library's setting" in r.output, r.output
