"""KvcxCache says what is wrong, early (hardening, second round): head dims the scheme cannot take get the
fallback codec when the cache is made, and updates that do not continue the cache are errors naming the layer."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from kvcx.cache import KvcxCache  # noqa: E402
from kvcx.errors import KvcxError  # noqa: E402


def _config(head_dim=64, layers=2):
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       hidden_size=4 * head_dim, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [80, 96, 40])
def test_head_dims_the_rotation_cannot_take_get_the_fallback_at_once(head_dim):
    cache = KvcxCache(_config(head_dim))
    value = cache.layers[0].kv_config.value
    assert not value.rotate and value.axis == "token"   # decided when the cache is made
    for step in range(70):   # past the first packing (64 tokens)
        for i in range(2):
            k = torch.randn(1, 2, 1, head_dim)
            out_k, _ = cache.update(k, k.clone(), i)
    assert cache.layers[0].quantized_length == 64 and out_k.shape == (1, 2, 70, head_dim)
    assert torch.isfinite(out_k).all()


def test_updates_that_do_not_continue_the_cache_name_the_layer():
    cache = KvcxCache(_config())
    k = torch.randn(1, 2, 3, 64)
    cache.update(k, k.clone(), 0)
    bad = [(torch.randn(2, 2, 1, 64), "batch"), (torch.randn(1, 3, 1, 64), "heads"),
           (torch.randn(1, 2, 1, 32), "head dim"), (torch.randn(1, 2, 1, 64, dtype=torch.float64), "dtype")]
    for t, what in bad:
        with pytest.raises(KvcxError, match="KvcxCache layer 0: this step's keys are"):
            cache.update(t, t.clone(), 0)
    with pytest.raises(KvcxError, match="layer 1: keys .* and values .* must be tensors of one shape"):
        cache.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 2, 64), 1)
    for idx in (2, -1, "0"):
        with pytest.raises(KvcxError, match="outside this KvcxCache's 2 layers"):
            cache.update(k, k.clone(), idx)


@pytest.mark.parametrize("scheme", ["q4_0-rot", "q8_0", "fp8_e4m3"])
def test_engine_formats_serve_as_kvcx_cache(scheme):
    """An engine's format in KvcxCache: every packed token equals the codec's own round trip of it."""
    from kvcx.codecs import KVConfig

    cache = KvcxCache(_config(64, layers=1), scheme=scheme, residual_length=32)
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 80, 64), torch.randn(1, 2, 80, 64)
    cache.update(k, v, 0)                       # the prompt's step attends to it exact; then it is packed
    k1, v1 = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    out_k, out_v = cache.update(k1, v1, 0)
    q = cache.layers[0].quantized_length
    assert q >= 32 and out_k.shape == (1, 2, 81, 64) and torch.equal(out_k[:, :, 80:], k1)
    codec = KVConfig.from_scheme(scheme).key
    want = codec.decode(codec.encode(k[:, :, :q].numpy()))
    assert torch.equal(out_k[:, :, :q], torch.from_numpy(want)) and torch.equal(out_k[:, :, q:80], k[:, :, q:])
    assert not torch.equal(out_v[:, :, :q], v[:, :, :q])      # values went through the format too
