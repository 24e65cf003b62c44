"""The model families of 2026 as tiny random-weight models, built from transformers' own config classes (no
download): what tests/cache/test_families.py and bench/bench_families.py run. They prove code paths and memory,
not quality (quality is measured on the embedded model).

Each family has the layer pattern of its real models at a small scale: 4 layers, 3 windowed (sliding or chunked)
to 1 full where the family mixes them, 4 query heads over 2 KV heads of 64 channels (the head dim real models
use, so that the default scheme's per-token value groups hold whole tokens), a window of ``window`` tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 128, 4, 2, 64, 4, 256
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
TRAIN_SHARE = 0.9   # the text's first 90 % trains the byte-level models; prompts come from the rest


def _common(window: int, prompt: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=192, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                max_position_embeddings=max(4096, 4 * prompt), pad_token_id=0, bos_token_id=1, eos_token_id=2)


SLIDING_3_1 = ["sliding_attention"] * 3 + ["full_attention"]


def family_configs(window: int = 64, prompt: int = 512) -> Dict[str, Callable[[], object]]:
    """name -> a function making the family's config (transformers imported when called)."""
    import transformers as T

    c = _common(window, prompt)
    no_head_dim = {k: v for k, v in c.items() if k != "head_dim"}
    return {
        "Llama": lambda: T.LlamaConfig(**c),
        "Qwen3": lambda: T.Qwen3Config(**c),
        "Qwen3-MoE": lambda: T.Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
        "Phi-3": lambda: T.Phi3Config(**c),
        "Mistral (sliding)": lambda: T.MistralConfig(**c, sliding_window=window),
        "Gemma 2": lambda: T.Gemma2Config(**c, sliding_window=window, query_pre_attn_scalar=48,
                                          layer_types=SLIDING_3_1),
        "Gemma 3": lambda: T.Gemma3TextConfig(**c, sliding_window=window, layer_types=SLIDING_3_1),
        "Gemma 4": lambda: T.Gemma4TextConfig(**c, sliding_window=window, global_head_dim=128,
                                              num_global_key_value_heads=1, attention_k_eq_v=True,
                                              layer_types=SLIDING_3_1, hidden_size_per_layer_input=16,
                                              vocab_size_per_layer_input=VOCAB),
        "GPT-OSS": lambda: T.GptOssConfig(**c, sliding_window=window, num_local_experts=4, num_experts_per_tok=2,
                                          layer_types=SLIDING_3_1),
        "OLMo 3": lambda: T.Olmo3Config(**c, sliding_window=window, layer_types=SLIDING_3_1),
        "Llama 4 (chunked)": lambda: T.Llama4TextConfig(
            **c, attention_chunk_size=window, num_local_experts=2, intermediate_size_mlp=192,
            layer_types=["chunked_attention"] * 3 + ["full_attention"], no_rope_layers=[1, 1, 1, 0]),
        "Qwen 3.5 (linear)": lambda: T.Qwen3_5TextConfig(
            **c, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32),
        "DeepSeek V3 (MLA)": lambda: T.DeepseekV3Config(
            **{**no_head_dim, "num_key_value_heads": HEADS}, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32,
            qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            n_group=1, topk_group=1, moe_intermediate_size=64),
    }


# a family with a layer type kvcx cannot pack (DeepSeek V4's compressed attention)
def unsupported_config(window: int = 64, prompt: int = 512):
    import transformers as T

    c = {k: v for k, v in _common(window, prompt).items() if k not in ("head_dim", "num_key_value_heads")}
    return T.DeepseekV4Config(**c, head_dim=64, num_key_value_heads=1, sliding_window=window, q_lora_rank=64,
                              o_lora_rank=64, index_head_dim=32, index_n_heads=2, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64,
                              layer_types=["sliding_attention", "compressed_sparse_attention",
                                           "sliding_attention", "heavily_compressed_attention"])


def build(name_or_config, seed: int = 0, dtype=None, attn: Optional[str] = None):
    """The model of a family (a name of :func:`family_configs`, or a config), seeded random weights, in eval mode;
    ``attn``: its attention implementation ("eager": the reference; "kvcx")."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[name_or_config]() if isinstance(name_or_config, str) else name_or_config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn or "eager")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def use_sdpa(model):
    """``model`` in SDPA attention where its family takes it, else eager (GPT-OSS's sinks: eager only)."""
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:
        model.set_attn_implementation("eager")
    return model


def temper(model, name: str):
    """Gemma 4 attends with scaling 1.0 (``query_pre_attn_scalar`` gone): a trained model's ``q_norm`` weights
    set its softmax's temperature; at random init they are 1 and the scores of RMS-normed queries and keys have a
    standard deviation of sqrt(head_dim), a hard argmax no trained model runs at. :func:`build_tempered` gives its
    ``q_norm`` weights head_dim^-0.5 (scores of unit deviation, as the other families' 1/sqrt(head_dim) scaling
    gives); the other families are left as built."""
    import torch

    if name.startswith("Gemma 4"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.5)
    return model


def text_bytes(path=DEFAULT_TEXT) -> Tuple[object, object]:
    """(train, held out): a text file's bytes as two int64 tensors, its first ``TRAIN_SHARE`` and the rest. The
    families' vocabulary is 256, so a byte is a token: the tiny models can learn real text with no tokenizer."""
    import torch

    data = Path(path).read_bytes()
    if len(data) < 1024:
        raise ValueError(f"{path}: {len(data)} bytes; the byte-level training needs a text of 1 KiB or more "
                         "(WikiText-2's wiki.test.raw)")
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(t) * TRAIN_SHARE)
    return t[:cut], t[cut:]


def train(model, text, steps: int, seq: int = 256, batch: int = 16, lr: float = 3e-3, seed: int = 0) -> List[float]:
    """Train ``model`` in place as a byte-level language model on ``text`` (int64 bytes): ``steps`` AdamW steps on
    ``batch`` windows of ``seq`` bytes at seeded random offsets (warm-up 20 steps, then linear decay to 0.1 lr).
    A random model's next-token distribution is flat; a few hundred steps give it the confident next tokens of a
    trained model (and its attention something to attend to), so that token agreement measures the cache rather than
    the model's near-ties. Returns the loss (nats a byte) at each step. Leaves the model in eval mode, FP32, with
    its eager attention."""
    import torch

    if len(text) <= seq + 1:
        raise ValueError(f"train: a text of {len(text)} bytes holds no window of {seq} + 1; pass a longer text")
    g = torch.Generator().manual_seed(seed)
    use_sdpa(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        offsets = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
        x = torch.stack([text[o:o + seq] for o in offsets.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    model.set_attn_implementation("eager")
    return losses


def text_prompts(held, tokens: int, steps: int, n: int):
    """``n`` prompts of ``tokens`` bytes from the held-out text, each at its own offset (the i-th at i (tokens +
    steps)): a list of (ids [1, tokens], mask, the text's own next ``steps`` bytes [1, steps])."""
    import torch

    span = tokens + steps
    if n * span > len(held):
        raise ValueError(f"text_prompts: {n} prompts of {tokens} + {steps} bytes need {n * span} held-out bytes; "
                         f"the text holds {len(held)}: ask for fewer prompts or a shorter window")
    out = []
    for i in range(n):
        chunk = held[i * span:(i + 1) * span][None]
        out.append((chunk[:, :tokens], torch.ones(1, tokens, dtype=torch.long), chunk[:, tokens:]))
    return out


def prompts(batch: int, tokens: int, pad: int = 0, seed: int = 1):
    """(input ids [batch, tokens], attention mask): random tokens (3..VOCAB), row b > 0 left-padded by 7 b
    tokens (pad id ``pad``, mask 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    for b in range(1, batch):
        ids[b, :7 * b] = pad
        mask[b, :7 * b] = 0
    return ids, mask


def decode(model, cache, ids, mask, steps: int, forced=None):
    """Greedy decoding of ``steps`` tokens after the prompt ``ids`` (left-padded rows: ``mask``), one token a
    forward as generate() runs it (positions from the mask); ``forced`` [B, steps]: feed these tokens instead of
    the model's own (teacher forcing). Returns (tokens [B, steps], logits [B, steps, vocab] float32)."""
    import torch

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    toks, logits = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        for i in range(steps):
            lg = out.logits[:, -1].float()
            logits.append(lg)
            nxt = lg.argmax(-1) if forced is None else forced[:, i]
            toks.append(nxt)
            if i + 1 == steps:
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                        use_cache=True)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def decoded_caches(model, ids, mask, steps: int, **kvcx):
    """(DynamicCache(config=...) after the prompt and ``steps`` greedy tokens with the model's eager attention,
    KvcxCache(config, **kvcx) after the same with the "kvcx" attention): what the memory checks compare."""
    from transformers import DynamicCache

    from kvcx.cache import KvcxCache

    model.set_attn_implementation("eager")
    dynamic = DynamicCache(config=model.config)
    decode(model, dynamic, ids, mask, steps)
    model.set_attn_implementation("kvcx")
    cache = KvcxCache(model.config, **kvcx)
    decode(model, cache, ids, mask, steps)
    return dynamic, cache


def step_kl(ref_logits, logits):
    """KL(ref || kvcx) of each row's and step's next-token distribution: [rows, steps] from logits [rows, steps,
    vocab]."""
    import torch

    lp, lq = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def kl(ref_logits, logits) -> float:
    """Mean KL(ref || kvcx) of the next-token distributions, over rows and steps."""
    return float(step_kl(ref_logits, logits).mean())


def attention_branch(model, ids, mask, tail: int = 64) -> dict:
    """layer index -> {"residual": the rms of the residual stream entering the decoder layer, "branch": the rms of
    what its attention adds to it}, over the prompt's last ``tail`` tokens, in one forward. What attention adds is
    its module's output, or where the layer normalizes that before the sum (Gemma 2/3/4: a post_attention_layernorm
    beside a pre_feedforward_layernorm) the norm's output: at random init a small attention output (near-uniform
    weights over random values) normalized up to the norm's unit scale."""
    import torch

    got, hooks = {}, []

    def rms(t):
        return float(t[0, -tail:].float().pow(2).mean().sqrt())

    def entering(i):
        def hook(mod, args, kwargs):
            got.setdefault(i, {})["residual"] = rms(args[0] if args else kwargs["hidden_states"])
        return hook

    def adds(i):
        def hook(mod, args, out):
            got.setdefault(i, {})["branch"] = rms(out[0] if isinstance(out, tuple) else out)
        return hook

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(entering(i), with_kwargs=True))
        normed = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_attention_layernorm")
        attn = layer.post_attention_layernorm if normed else getattr(layer, "self_attn", None)
        if attn is not None:   # (a linear-attention layer has none: no branch of its keys and values)
            hooks.append(attn.register_forward_hook(adds(i)))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    return got
