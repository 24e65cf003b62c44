import pytest


@pytest.fixture
def kvcx_attention(loaded):
    """The model with kvcx's attention implementation (SDPA but for KvcxCache's fused steps), restored after."""
    pytest.importorskip("torch")
    from kvcx.cache.attention_fn import kvcx_attention as using

    with using(loaded[0]) as model:
        yield model


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Llama (4 query heads over 2 KV heads, head dim 32) with kvcx's attention, on the GPU where
    there is one (the Triton kernels compiled) else on the CPU (Triton's interpreter)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvcx.cache  # noqa: F401  (registers the "kvcx" attention implementation)

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                      intermediate_size=256, vocab_size=256, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval().to("cuda" if torch.cuda.is_available() else "cpu")
    model.set_attn_implementation("kvcx")
    return model
