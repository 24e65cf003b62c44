"""bench/bench_families.py's trained page (a run at a small scale) and the helpers it trains and prompts with
(bench/families.py): the tiny models, trained as byte-level language models on the text's first 90 %, learn it;
the prompts are the held-out rest with the text's own next bytes; the page's row counts what its columns say and the
README's headline row reads it; bad arguments are one line."""
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import bench_families, publish  # noqa: E402
from bench.families import TRAIN_SHARE, build, family_configs, text_bytes, text_prompts, train  # noqa: E402


def test_text_bytes_splits_the_text_and_refuses_a_text_too_short(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(32, 127)) * 20)
    head, rest = text_bytes(path)
    data = path.read_bytes()
    assert len(head) == int(len(data) * TRAIN_SHARE) and len(head) + len(rest) == len(data)
    assert bytes(head.tolist()) + bytes(rest.tolist()) == data and head.dtype == torch.int64
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match=r"t.txt: 5 bytes.*1 KiB or more"):
        text_bytes(path)


def test_the_prompts_are_the_held_out_text_and_its_own_next_bytes():
    held = torch.arange(1000) % 251
    items = text_prompts(held, 64, 4, 3)
    assert len(items) == 3
    for i, (ids, mask, nxt) in enumerate(items):
        o = i * 68
        assert torch.equal(ids[0], held[o:o + 64]) and torch.equal(nxt[0], held[o + 64:o + 68])
        assert mask.shape == (1, 64) and bool(mask.all())
    with pytest.raises(ValueError, match=r"15 prompts of 64 \+ 4 bytes need 1020 held-out bytes; the text holds 1000"):
        text_prompts(held, 64, 4, 15)


def test_training_lowers_a_family_models_loss_on_the_text(wikitext_path):
    """30 steps on WikiText-2's bytes: a random model's loss (about ln 256 = 5.5 nats a byte) falls by more than one
    nat; seeded, the same steps give the same losses; the model is left in eval mode with its eager attention."""
    head, _ = text_bytes(wikitext_path)
    losses = []
    for _ in range(2):
        model = build(family_configs(16, 128)["Llama"]())
        losses.append(train(model, head, 30, seq=64, batch=4))
    first, last = losses[0][0], sum(losses[0][-5:]) / 5
    assert abs(first - 5.55) < 0.3 and last < first - 1.0, losses[0]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    assert not model.training and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="holds no window of 64"):
        train(model, head[:40], 1, seq=64)


def test_the_trained_page_counts_its_tokens_and_the_headline_reads_it(tmp_path, wikitext_path, monkeypatch):
    page = tmp_path / "families-trained.md"
    monkeypatch.setattr(bench_families, "TARGET_TOKENS", 1.01)   # every row below it: the layer shares run too
    bench_families.main(["--train-steps", "20", "--window", "16", "--steps", "3", "--prompts", "2",
                         "--families", "Mistral", "--text", str(wikitext_path), "--markdown", str(page)])
    text = page.read_text()
    assert "trained 20 steps" in text and "2 held-out prompts of 128 bytes" in text
    row = next(line.split(" | ") for line in text.splitlines() if line.startswith("| Mistral (sliding) |"))
    first, last = (float(x) for x in re.match(r"([\d.]+) -> ([\d.]+)", row[1]).groups())
    assert last < first
    shares = [re.match(r"([\d.]+)% \((\d+)\)", cell) for cell in row[2:7] + [row[8]]]
    for m in shares:   # each share: its count of the 6 tokens (2 prompts x 3)
        assert m and 0 <= int(m.group(2)) <= 6 and float(m.group(1)) == pytest.approx(int(m.group(2)) / 6 * 100, abs=0.06)
    assert float(row[7]) >= -1e-6 and 0 <= float(row[10]) <= 1   # the KL, the reference's top-1 lead
    lo, hi = (float(x) for x in re.fullmatch(r"([\d.]+)%-([\d.]+)%", row[11]).groups())   # its interval over prompts
    assert lo <= float(shares[0].group(1)) <= hi
    met = re.search(r"target >= 101% on the default scheme: met by ([01]) of 1 rows; below it \(in brackets: the 95 % "
                    r"interval over prompts, a bootstrap\): Mistral \(sliding\) [\d.]+% \(([\d.]+)%-([\d.]+)%\)", text)
    assert met and met.group(1) == "0" and (float(met.group(2)), float(met.group(3))) == (lo, hi)
    layers = [line.split(" | ") for line in text.split("error enters")[1].splitlines()
              if line.startswith("| Mistral (sliding) |")]
    assert [int(x[1]) for x in layers] == [0, 1, 2, 3] and all(float(x[3]) >= -1e-6 for x in layers)
    (tmp_path / "families.md").write_text((publish.RESULTS / "families.md").read_text())
    monkeypatch.setattr(publish, "RESULTS", tmp_path)
    assert f"greedy tokens in {int(float(shares[0].group(1)) >= 90)} of 1 rows ([trained](docs/results/families-trained.md))" in \
        publish.families()


def test_the_interval_over_prompts_holds_the_share_and_narrows_with_more_prompts():
    """The bootstrap resamples prompts: all prompts alike give no width; the same spread of counts over 3x the
    prompts gives a narrower interval around the same share; the seed makes it repeatable."""
    assert bench_families.prompt_interval([16] * 8, 16) == (1.0, 1.0)
    few = [16, 16, 4, 16, 9, 16, 16, 11]
    lo, hi = bench_families.prompt_interval(few, 16)
    share = sum(few) / (len(few) * 16)
    assert lo < share < hi <= 1.0
    lo3, hi3 = bench_families.prompt_interval(few * 3, 16)
    assert lo < lo3 < share < hi3 < hi
    assert bench_families.prompt_interval(few, 16) == (lo, hi)


@pytest.mark.parametrize("args, says", [
    (["--train-steps", "-1"], "0 training steps or more"),
    (["--train-steps", "5", "--text", "/nonexistent/wiki.test.raw"], "no such file"),
    (["--train-steps", "5", "--prompts", "1000"], "need 2064000 held-out bytes"),
    (["--train-steps", "5", "--text", "TINY"], "1 KiB or more"),
])
def test_bad_arguments_are_one_line(args, says, capsys, wikitext_path, tmp_path):
    if "--text" not in args:
        args = args + ["--text", str(wikitext_path)]
    if "TINY" in args:
        (tmp_path / "tiny.txt").write_bytes(b"too short")
        args = [str(tmp_path / "tiny.txt") if a == "TINY" else a for a in args]
    with pytest.raises(SystemExit) as exc:
        bench_families.main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and says in err


def test_the_layer_study_reads_each_rows_most_sensitive_layer_from_the_page(tmp_path):
    """bench.study_family_layers takes, for each family of the page's layer table, the layer whose KL alone is the
    largest, and the page's training steps and window; a page without them is one line naming the fix."""
    from bench import study_family_layers

    page = tmp_path / "families-trained.md"
    page.write_text("## Every family trained 120 steps, batch 1: 8 held-out prompts of 512 bytes (8x a 64-byte "
                    "window), each then 16 greedy tokens\n\n| Llama | 5.6 -> 2.2 | 79.7% (102) |\n\n"
                    "## Where the default scheme's error enters, in the rows below the greedy target\n\n"
                    "| family | layer | type | KL | residual | adds |\n|---|---:|---|---:|---:|---:|\n"
                    "| Llama | 0 | full | 0.000327 | 0.032 | 1.771 |\n| Llama | 3 | full | 0.000493 | 3.019 | 1.006 |\n"
                    "| Gemma 3 | 0 | sliding | 0.000258 | 0.685 | 0.986 |\n| Gemma 3 | 1 | sliding | 0.000008 | 1.4 | 0.9 |\n")
    assert study_family_layers.sensitive_layers(page) == (120, 64, 8, {"Llama": (3, 0.000493), "Gemma 3": (0, 0.000258)})
    page.write_text("# nothing measured\n")
    with pytest.raises(SystemExit, match="no trained families table with a layer table; run bench.bench_families"):
        study_family_layers.sensitive_layers(page)


@pytest.mark.parametrize("args, says", [(["--steps", "0"], "1 greedy token or more"),
                                        (["--text", "TINY"], "1 KiB or more"),
                                        (["--page", "STRANGER"], "names Falcon 9, not a family of")])
def test_the_layer_studys_bad_arguments_are_one_line(args, says, capsys, tmp_path):
    """Before any model trains: a usage line, never a traceback."""
    from bench import study_family_layers

    (tmp_path / "tiny.txt").write_bytes(b"too short")
    (tmp_path / "stranger.md").write_text("## Every family trained 10 steps, batch 1: 8 held-out prompts of 256 bytes "
                                          "(8x a 32-byte window)\n\n## Where the default scheme's error enters\n\n"
                                          "| Falcon 9 | 0 | full | 0.0001 | 1.0 | 1.0 |\n")
    args = [{"TINY": str(tmp_path / "tiny.txt"), "STRANGER": str(tmp_path / "stranger.md")}.get(a, a) for a in args]
    with pytest.raises(SystemExit) as exc:
        study_family_layers.main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and says in err


def test_first_divergence_names_the_step_and_the_references_lead_there():
    """The first step where the tokens leave the reference's, and the reference's top-1 minus its second
    probability at that step; None where none does."""
    import torch

    from bench.study_family_layers import first_divergence

    ref = torch.tensor([[5, 6, 7, 8]])
    logits = torch.zeros(1, 4, 10)
    logits[0, 2, 7], logits[0, 2, 3] = 2.0, 1.0
    p = torch.softmax(logits[0, 2], -1).topk(2).values
    step, lead = first_divergence(torch.tensor([[5, 6, 3, 3]]), ref, logits)
    assert step == 2 and lead == pytest.approx(float(p[0] - p[1])) and lead > 0.1
    assert first_divergence(ref.clone(), ref, logits) is None


def test_with_bits_changes_one_half_of_the_default():
    from bench.study_family_layers import with_bits
    from kvcx.codecs import KVConfig

    base = KVConfig.from_scheme("kvcx")
    keys8 = with_bits(base, "key", 8)
    assert keys8.key.bits == 8 and keys8.key.axis == base.key.axis and keys8.key.sinks == base.key.sinks
    assert keys8.value.get_config() == base.value.get_config()
    values8 = with_bits(base, "value", 8)
    assert values8.value.bits == 8 and values8.value.rotate and values8.key.get_config() == base.key.get_config()


def test_the_layer_study_runs_end_to_end_on_a_briefly_trained_model(tmp_path):
    """The whole study on one family trained 10 steps (a 32-byte window, 4 greedy tokens): both tables, a row
    each, every count out of the 8 prompts x 4 tokens, and the sentence on which half holds the KL."""
    import re

    from bench import study_family_layers

    page = tmp_path / "families-trained.md"
    page.write_text("## Every family trained 10 steps, batch 1: 8 held-out prompts of 256 bytes (8x a 32-byte "
                    "window), each then 16 greedy tokens\n\n## Where the default scheme's error enters\n\n"
                    "| Llama | 3 | full | 0.000493 | 3.019 | 1.006 |\n")
    out = tmp_path / "plan.md"
    study_family_layers.main(["--page", str(page), "--steps", "4", "--markdown", str(out)])
    text = out.read_text()
    plan = re.search(r"\| Llama \| 3 \(0\.000493\) \| 4 \| [\d.]+% \((\d+)\) \| [\d.]+% \((\d+)\) \| (met|missed) \|", text)
    assert plan and all(0 <= int(n) <= 32 for n in plan.groups()[:2])
    misses = re.search(r"\| Llama \| (\d) of 8 \| [^|]+ \| (\d) of 8 \| [^|]+ \| -?[\d.]+ \| [\d.]+% \((\d+)\) "
                       r"\| -?[\d.]+ \| [\d.]+% \((\d+)\) \| -?[\d.]+ \|", text)
    assert misses and all(0 <= int(n) <= 32 for n in misses.groups()[2:])
    assert "Which half of the default's codes holds more of the KL" in text
    assert "the RoPE key on 8-bit codes" not in text   # (said for an MLA family only)
    # transformers' QuantizedCache takes Llama (full attention only): its count out of the same 32 tokens, the default
    # scheme's count the same as the first table's
    peer = re.search(r"\| Llama \| [\d.]+% \((\d+)\) \| [\d.]+ \| [\d.]+% \((\d+)\) \| [\d.]+ \|", text)
    assert peer and peer.group(1) == plan.group(1) and 0 <= int(peer.group(2)) <= 32
    assert re.search(r"meets the greedy target in [01] of the 1 rows it takes", text)


def test_the_peer_is_transformers_quantized_cache_or_its_own_refusal():
    """quanto_cache: a factory of transformers' QuantizedCache for a full-attention family; for a family with
    sliding layers transformers' own refusal, said, not a cache."""
    from bench.families import build, family_configs
    from bench.study_family_layers import quanto_cache

    configs = family_configs(32, 256)
    make = quanto_cache(build(configs["Llama"]()))
    assert callable(make) and type(make()).__name__ == "QuantizedCache"
    why = quanto_cache(build(configs["Gemma 4"]()))
    assert isinstance(why, str) and why.startswith("refused:") and "full attention" in why


def test_the_gate_page_runs_every_part_of_the_gate_on_a_family(tmp_path, wikitext_path, loaded):
    """bench_families_gate on DeepSeek V3's MLA: every mode, both plans (kvcx2w refused, with its reason) and the
    ruler task give one row; the page names the MLA layers the setting coded at 8 bits; bad arguments are usage
    lines."""
    from bench import bench_families_gate

    page = tmp_path / "gate.md"
    bench_families_gate.main(["--families", "DeepSeek V3 (MLA)", "--window", "256", "--text", str(wikitext_path),
                              "--markdown", str(page)])
    row = [line for line in page.read_text().splitlines() if line.startswith("| DeepSeek V3 (MLA) |")]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells[1] == "4 full" and cells[5] == "0, 1, 2, 3"
    kld, top1, bits = (float(x) for x in cells[2].split(" / "))
    assert 0 < kld < 0.01 and 0.5 < top1 <= 1 and 5.6 < bits < 7.2   # the RoPE key's 8 bits beside the latent's 4
    assert cells[6].startswith("3.00 over 4 layers") and cells[7].startswith("refused: layer 0 is multi-head latent")
    for args in (["--families", "Falcon 9"], ["--window", "100"], ["--text", str(tmp_path / "none.raw")]):
        with pytest.raises(SystemExit) as exc:
            bench_families_gate.main(args)
        assert exc.value.code == 2


def test_the_route_recorder_reads_each_routers_experts_for_each_forward():
    """On a tiny Qwen3-MoE: one entry a forward (the prompt, then each step), one set of top_k experts a router; the
    same cache twice picks the same experts; a dense model has no routers."""
    import torch
    from transformers import DynamicCache

    from bench.families import build, decode, family_configs, prompts, temper
    from bench.families import step_kl
    from bench.study_family_layers import RouteRecorder

    configs = family_configs(16, 128)
    cfg = configs["Qwen3-MoE"]()
    torch.manual_seed(0)
    model = temper(build(cfg), "Qwen3-MoE")
    model.set_attn_implementation("eager")
    ids, mask = prompts(1, 32)
    runs = []
    for _ in range(2):
        with RouteRecorder(model) as rec:
            _, logits = decode(model, DynamicCache(config=model.config), ids, mask, 3)
        runs.append((rec, logits))
    rec = runs[0][0]
    assert rec.routers == cfg.num_hidden_layers and len(rec.forwards) == 3
    assert all(len(f) == rec.routers and all(len(e) == cfg.num_experts_per_tok for e in f) for f in rec.forwards)
    assert rec.forwards == runs[1][0].forwards
    assert step_kl(runs[0][1], runs[1][1])[0].tolist() == pytest.approx([0.0] * 3, abs=1e-6)
    dense = temper(build(configs["Llama"]()), "Llama")
    with RouteRecorder(dense) as none:
        decode(dense, DynamicCache(config=dense.config), ids, mask, 2)
    assert none.routers == 0 and none.forwards == []


def test_the_routing_section_says_how_much_of_the_kl_the_flipped_steps_hold():
    from bench.report import Report
    from bench.study_family_layers import routing_section

    out = Report()
    routing_section(out, [{"name": "Llama", "routes": []},
                          {"name": "Qwen3-MoE", "routes": [(True, 0.03), (False, 0.001), (False, 0.002), (True, 0.01)]}])
    row = next(line for line in out.lines if line.startswith("| Qwen3-MoE |"))
    assert row == "| Qwen3-MoE | 4 | 2 | 0.020000 | 0.001500 | 93% |"
    assert not any(line.startswith("| Llama |") for line in out.lines)
    empty = Report()
    routing_section(empty, [{"name": "Llama", "routes": []}])
    assert empty.lines == []


def _trained_page(path, machine, rows):
    """A trained families page as bench_families writes it: the Machine line and the main table's first columns."""
    path.write_text(f"Command: x. Machine: {machine}. Date: 2026-12-07.\n\n## Every family trained 200 steps, batch 1: "
                    "24 held-out prompts\n\n| family | training loss | greedy, default scheme | greedy, 8-bit codes "
                    "| greedy, fp8_e4m3 (vLLM) | greedy, the model in BF16 |\n|---|---:|---:|---:|---:|---:|\n"
                    + "".join(f"| {f} | 5.6 -> {loss} | {d} | 100.0% (384) | 90.0% (346) | {bf} |\n"
                              for f, loss, d, bf in rows))
    return path


def test_the_machines_section_sets_two_runs_greedy_columns_side_by_side(tmp_path):
    """Two machines' trained pages: a row per family in both, each side's cells as its page has them, the target's
    count on each side, the rows below it on both and the largest move."""
    from bench.report import Report
    from bench.study_family_layers import machines_section

    here = _trained_page(tmp_path / "families-trained.md", "AVX2 box", [
        ("Llama", "2.27", "88.3% (339)", "60.0% (230)"), ("Qwen3", "2.08", "95.6% (367)", "92.2% (354)"),
        ("Gemma 4", "1.91", "80.0% (307)", "72.4% (278)")])
    (tmp_path / "history").mkdir()
    there = _trained_page(tmp_path / "history" / "families-trained-avx512.md", "AVX-512 box", [
        ("Llama", "2.25", "75.5% (290)", "58.1% (223)"), ("Qwen3", "2.09", "96.0% (369)", "93.0% (357)"),
        ("Gemma 4", "1.90", "87.8% (337)", "70.0% (269)")])
    out = Report()
    machines_section(out, here, there)
    page = tmp_path / "out.md"
    out.write(page, "# t\n\n")
    text = page.read_text()
    assert "(Machine: AVX2 box)" in text and "(Machine: AVX-512 box)" in text
    assert "| Llama | 2.27 | 2.25 | 88.3% (339) | 75.5% (290) | 100.0% (384) | 100.0% (384) | 60.0% (230) | 58.1% (223) |" \
        in text
    assert "in 1 of 3 rows here and in 1 there; below it on both machines: Llama, Gemma 4" in text
    assert "The largest move between the two draws: Llama, 75.5 % there, 88.3 % here." in text
