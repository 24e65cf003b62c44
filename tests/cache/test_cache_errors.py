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
