"""KvcxCache on the real embedded model: memory, token agreement, generate(), GQA, padding, dtypes."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvcx.errors import KvcxError, ModelError  # noqa: E402
from kvcx.deps import check_transformers_version  # noqa: E402

pytestmark = pytest.mark.model




@pytest.fixture(scope="module")
def wiki_ids(loaded, wikitext_path):
    _, tok, _ = loaded
    text = wikitext_path.read_text(encoding="utf-8")[:60000]
    return torch.tensor(tok(text)["input_ids"][:4200])[None]


def test_memory_at_4096_tokens(loaded, wiki_ids):
    from kvcx.hf import KvcxCache, dynamic_cache_bytes
    from kvcx.kv_cache import cache_layers

    model, _, _ = loaded
    dyn = DynamicCache()
    with torch.inference_mode():
        model(wiki_ids[:, :4096], past_key_values=dyn, use_cache=True)
    kv = KvcxCache(model.config)
    for i, (k, v) in enumerate(cache_layers(dyn)):  # what the model's attention layers do during prefill
        kv.update(k, v, i)
    rep = kv.memory_report()
    fp32 = dynamic_cache_bytes(dyn)
    assert rep["tokens"] == 4096 and rep["model_dtype_equivalent_bytes"] == fp32
    fp16 = fp32 // 2
    assert rep["total_bytes"] <= 0.30 * fp16, rep
    assert rep["total_bytes"] <= 0.15 * fp32, rep
    layer = kv.layers[0]
    assert len(layer.store) and layer.store.keys.codes.dtype == np.uint8  # really packed, not dequantized copies
    assert layer.quantized_length == 4096 and layer.keys.shape[-2] == 0


def test_teacher_forced_agreement_and_generate(loaded, wiki_ids):
    from kvcx.hf import KvcxCache

    model, tok, _ = loaded
    prompt, steps = 1024, 32
    preds = {}
    for name, cache in (("dyn", DynamicCache()), ("kvcx", KvcxCache(model.config))):
        with torch.inference_mode():
            out = model(wiki_ids[:, :prompt], past_key_values=cache)
            p = [int(out.logits[0, -1].argmax())]
            for j in range(prompt, prompt + steps - 1):
                p.append(int(model(wiki_ids[:, j:j + 1], past_key_values=cache).logits[0, -1].argmax()))
        preds[name] = p
    assert cache.get_seq_length() == prompt + steps - 1
    agree = np.mean([a == b for a, b in zip(preds["dyn"], preds["kvcx"])])
    assert agree >= 0.9, agree
    with torch.inference_mode():
        g = model.generate(wiki_ids[:, :300], past_key_values=KvcxCache(model.config, residual_length=128),
                           max_new_tokens=12, do_sample=False)
    text = tok.decode(g[0, 300:])
    assert g.shape[1] == 312 and len(text.strip()) > 0


def test_batch_with_left_padding_matches_batch_one(loaded, wiki_ids):
    from kvcx.hf import KvcxCache

    model, tok, _ = loaded
    a = wiki_ids[0, :200]
    b = wiki_ids[0, 1000:1150]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = torch.full((2, 200), pad)
    batch[0] = a
    batch[1, 50:] = b
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :50] = 0
    with torch.inference_mode():
        gb = model.generate(batch, attention_mask=mask, past_key_values=KvcxCache(model.config, residual_length=64),
                            max_new_tokens=8, do_sample=False, pad_token_id=pad)
        g0 = model.generate(a[None], past_key_values=KvcxCache(model.config, residual_length=64),
                            max_new_tokens=8, do_sample=False, pad_token_id=pad)
        g1 = model.generate(b[None], past_key_values=KvcxCache(model.config, residual_length=64),
                            max_new_tokens=8, do_sample=False, pad_token_id=pad)
    assert gb[0, 200:].tolist() == g0[0, 200:].tolist()
    same = np.mean([x == y for x, y in zip(gb[1, 200:].tolist(), g1[0, 150:].tolist())])
    assert same >= 0.75, (gb[1, 200:].tolist(), g1[0, 150:].tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(loaded, wiki_ids, dtype):
    from kvcx.hf import KvcxCache

    model, _, _ = loaded
    cache = KvcxCache(model.config, residual_length=64)
    layers = model.config.num_hidden_layers
    rng = torch.Generator().manual_seed(0)
    for step in range(3):  # prefill of 130 tokens, then single tokens: packs, then decodes
        n = 130 if step == 0 else 1
        for i in range(layers):
            k = torch.randn(1, 3, n, 64, generator=rng).to(dtype)
            v = torch.randn(1, 3, n, 64, generator=rng).to(dtype)
            ko, vo = cache.update(k, v, i)
            assert ko.dtype == dtype and ko.shape[-2] == cache.layers[i].cumulative_length
    assert cache.layers[0].quantized_length == 128
    assert cache.layers[0].store.keys.chunk(0).dtype == ("BF16" if dtype == torch.bfloat16 else "F16")


def test_errors():
    from kvcx.hf import KvcxCache
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=2, hidden_size=32)
    with pytest.raises(KvcxError, match="residual_length \\(100\\) must be a multiple of the group size \\(64\\)"):
        KvcxCache(cfg, residual_length=100)
    with pytest.raises(ModelError, match="transformers 4.40.0 is not supported; kvcx works with >=5.0,<5.24"):
        check_transformers_version("4.40.0")
    cache = KvcxCache(cfg)
    with pytest.raises(KvcxError, match="beam search"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
