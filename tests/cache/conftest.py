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


@pytest.fixture
def checked():
    """kvcx's attention, also computing the reference attention (SDPA; FP32 eager where the model asks for
    softcapping or sinks) over the layer's context materialised, from the same query, on each fused step:
    records (layer, max |fused - reference|, max |reference|)."""
    pytest.importorskip("torch")
    from transformers.modeling_utils import AttentionInterface

    import kvcx.cache.attention_fn as kh

    records = []

    def checking(module, query, key, value, attention_mask, **kwargs):
        layer = kh.HANDOFF.peek(key)
        if layer is not None:  # before the step: after it, a full residual is packed
            k, v = (t.clone() for t in layer.full_states())
            m = attention_mask[..., -k.shape[-2]:] if attention_mask is not None else None   # a window's
        out = kh.kvcx_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if layer is not None:
            ref = kh.reference_attention(module, query, k, v, m, scaling=kwargs.get("scaling"),
                                         softcap=kwargs.get("softcap"), s_aux=kwargs.get("s_aux"))[0]
            records.append((module.layer_idx, (out[0] - ref).abs().max().item(), ref.abs().max().item()))
        return out

    AttentionInterface.register("kvcx", checking)
    try:
        yield records
    finally:
        AttentionInterface.register("kvcx", kh.kvcx_attention_forward)
