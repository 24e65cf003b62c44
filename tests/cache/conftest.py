import pytest


@pytest.fixture
def kvcx_attention(loaded):
    """The model with kvcx's attention implementation (SDPA but for KvcxCache's fused steps), restored after."""
    pytest.importorskip("torch")
    from kvcx.cache.attention_fn import kvcx_attention as using

    with using(loaded[0]) as model:
        yield model
