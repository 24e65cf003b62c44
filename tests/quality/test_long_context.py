"""Long windows and the passkey task on the real embedded model: the model runs in chunks and the output head
in slices (nothing of window x vocabulary size), with the same figures as one pass; passkey prompts answered
with the exact and the compressed cache on the same prompts."""
import json

import pytest

from kvcx.codecs import KVConfig
from kvcx.errors import KvcxError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from kvcx.cli import app  # noqa: E402
from kvcx.quality import retrieval, ruler, scoring  # noqa: E402
from kvcx.quality.validation import identity_roundtrip, run_validations  # noqa: E402

pytestmark = pytest.mark.model


def test_chunked_forward_and_sliced_head_equal_one_pass(loaded, wikitext_path):
    model, tok, _ = loaded
    ids = torch.tensor(tok(wikitext_path.read_text(encoding="utf-8")[:5000])["input_ids"][:200])[None]
    with torch.inference_mode():
        full = model(ids).logits[0]
        hidden, cache = scoring.forward_hidden(model, ids, chunk=64)   # 4 chunks: 64, 64, 64, 8
        assert hidden.shape == (200, model.config.hidden_size) and cache.get_seq_length() == 200
        torch.testing.assert_close(scoring.output_logits(model, hidden), full, atol=2e-4, rtol=1e-4)
        # the scores of a slice-wise head equal those of whole logit tensors, within FP32's rounding of the logits:
        # the head's matmul may block a 37-row slice and a 199-row tensor differently (bit for bit on AMD EPYC hosts;
        # up to about 2e-8 apart on an Intel Xeon with AMX), and the sums are of 199 such terms
        targets = ids[0, 1:]
        noisy = hidden[:-1] + 0.05 * torch.randn_like(hidden[:-1])
        base, comp, (kl, top1) = scoring.score_hidden(model, hidden[:-1], noisy, targets, slice_rows=37)
        b, c = scoring.output_logits(model, hidden[:-1]), scoring.output_logits(model, noisy)
        assert base == pytest.approx(scoring.sequence_nll(b, targets), rel=1e-6)
        assert comp == pytest.approx(scoring.sequence_nll(c, targets), rel=1e-6)
        ref_kl, ref_top1 = scoring.next_token_divergence(b, c)
        assert kl == pytest.approx(ref_kl, rel=1e-6) and kl > 0 and top1 == ref_top1 < 199


def test_long_window_never_holds_window_by_vocabulary(loaded, wikitext_path):
    """A window of 2,048 tokens (1,536 scored): every decoder call sees at most FORWARD_CHUNK tokens and every
    head call at most HEAD_SLICE rows, in each mode; the identity codec still gives a delta of exactly 0."""
    model, _, _ = loaded
    decoder_tokens, head_rows = [], []
    hooks = [model.get_decoder().register_forward_pre_hook(
                 lambda mod, args, kw: decoder_tokens.append(kw["input_ids"].shape[1]), with_kwargs=True),
             model.get_output_embeddings().register_forward_pre_hook(
                 lambda mod, args: head_rows.append(args[0].shape[-2]))]
    try:
        r = run_validations({"kvcx": KVConfig.from_scheme(), "exact": KVConfig.from_scheme()}, window=2048,
                            stride=1536, max_windows=1, dataset_file=wikitext_path, loaded=loaded,
                            roundtrips={"exact": identity_roundtrip})
        assert max(decoder_tokens) == scoring.FORWARD_CHUNK and max(head_rows) == scoring.HEAD_SLICE
        assert r[0].tokens_scored == 1535 and r[1].delta == 0.0 and r[1].kld == 0.0
        assert 0 < r[0].kld < 0.05 and abs(r[0].delta) < 0.5
        decoder_tokens.clear()
        head_rows.clear()
        e = run_validations({"q8_0": KVConfig.from_scheme("q8_0")}, window=2048, stride=1536, max_windows=1,
                            dataset_file=wikitext_path, loaded=loaded, mode="engine")[0]
        assert max(decoder_tokens) == scoring.FORWARD_CHUNK and max(head_rows) == scoring.HEAD_SLICE
        assert e.tokens_scored == 1535 and 0 < e.kld < 0.01
    finally:
        for h in hooks:
            h.remove()


def test_passkey_prompts():
    """The passkey prompt (ruler's ``passkey`` task): its length with the answer's room, the key at its depth, the
    same key for the same seed and another for another seed."""
    def encode(text):
        return [ord(ch) for ch in text]   # one token per character: lengths are exact

    def key_of(seed):
        return int(ruler.passkey_task(encode, None, 1024, 0.5, ruler.rng_for(seed, "passkey", 1024, 2, 1)).answers[0])

    key = key_of(0)
    assert 10000 <= key < 100000 and key == key_of(0) != key_of(1)
    for depth in (0.3, 0.5, 0.9):
        context, question = ruler.build_passkey_prompt(encode, 1024, depth, key)
        text = "".join(map(chr, context))
        assert len(context) + len(question) + ruler.ANSWER_TOKENS <= 1024
        assert len(context) + len(question) + ruler.ANSWER_TOKENS > 1024 - len(ruler.FILLER)
        at = text.index(f"pass key is {key}") / len(text)
        assert abs(at - depth) < 0.1 and text.startswith(ruler.INTRO)
    context, _ = ruler.build_passkey_prompt(encode, 1024, 0.0, key)   # as early as the introduction allows
    assert "".join(map(chr, context)).index("pass key") < len(ruler.INTRO) + 20
    assert ruler.default_lengths(8192) == [1024, 2048, 4096, 8192]
    assert ruler.default_lengths(3000) == [1024, 2048, 3000]
    with pytest.raises(KvcxError, match="no room"):
        ruler.build_passkey_prompt(encode, 150, 0.5, key)


def test_cli_passkey_table_json_and_bad_options():
    r = CliRunner().invoke(app, ["validate", "--task", "passkey", "--lengths", "512", "--prompts", "1",
                                 "--scheme", "kvcx,q8_0", "--json", "--cpu"])
    assert r.exit_code in (0, 3), r.output
    rows = json.loads(r.stdout)
    assert [x["setting"] for x in rows] == ["kvcx", "q8_0"] and all(x["task"] == "passkey" for x in rows)
    for x in rows:     # one cell: passkey at 512, its prompts over the five depths, the exact cache's beside it
        (cell,) = x["cells"]
        assert cell["task"] == "passkey" and cell["length"] == 512 and cell["prompts"] == len(retrieval.DEPTHS)
        assert cell["exact_correct"] == rows[0]["cells"][0]["exact_correct"]
        assert cell["ci_low"] <= cell["accuracy"] <= cell["ci_high"]
    assert r.exit_code == (0 if all(x["passed"] for x in rows) else 3)
    for args, match in ((["--lengths", "1k"], "--lengths '1k' must be token counts"),
                        (["--lengths", "64"], "--lengths 64: 64 is shorter than 256 tokens"),
                        (["--lengths", "1024,99999"], "99999 exceeds the model's context of 8192"),
                        (["--mode", "engine"], "passkey runs in prefix mode"),
                        (["--prompts", "0"], "--prompts 0 must be at least 1")):
        r = CliRunner().invoke(app, ["validate", "--task", "passkey", *args])
        assert r.exit_code == 1 and match in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(app, ["validate", "--lengths", "1024"])
    assert r.exit_code == 1 and "add --task ruler (or --task passkey)" in r.output
