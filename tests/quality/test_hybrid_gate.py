"""The gate on hybrid models: prefix, generation and engine modes run on models with sliding-window and linear-attention
layers (tiny random-weight models from transformers' config classes, with the embedded model's tokenizer), compress
what an engine compresses (every attention layer's keys and values, the sliding layers' window included; linear
attention's states kept) and score the same tokens as the exact cache."""
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvcx.codecs import KVConfig  # noqa: E402
from kvcx.quality.scoring import identity_roundtrip  # noqa: E402
from kvcx.quality.validation import run_validation  # noqa: E402


def _hybrid(kind, vocab):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    if kind == "sliding":
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=128,
                                            layer_types=["sliding_attention"] * 3 + ["full_attention"])
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                             linear_value_head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kind", ["sliding", "linear"])
def test_every_mode_gates_a_hybrid_model(loaded, wikitext_path, kind):
    _, tok, _ = loaded
    model = _hybrid(kind, len(tok))
    hybrid = (model, tok, f"tiny {kind} hybrid")
    exact = run_validation(KVConfig.from_scheme(), dataset_file=wikitext_path, max_windows=2, loaded=hybrid,
                           roundtrip=identity_roundtrip, window=512, stride=256)
    assert exact.delta == 0.0 and exact.kld == 0.0 and exact.top1_agreement == 1.0
    for mode in ("prefix", "generation", "engine"):
        r = run_validation(KVConfig.from_scheme(), dataset_file=wikitext_path, max_windows=2, loaded=hybrid,
                           mode=mode, window=512, stride=256)
        assert r.tokens_scored == 2 * 255 and r.baseline_perplexity == pytest.approx(exact.baseline_perplexity, rel=1e-6)
        assert math.isfinite(r.compressed_perplexity) and r.compressed_perplexity != r.baseline_perplexity, mode
        # a random model's next-token distribution is near uniform: its top-1 flips on noise, the KLD does not
        assert 0.0 < r.kld < 0.01 and r.top1_agreement > 0.5, (mode, r.kld, r.top1_agreement)
