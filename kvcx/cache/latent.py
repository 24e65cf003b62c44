"""Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi, GLM-4 MoE Lite, Mistral 4, ...) over the cached latent,
with the model's up-projection absorbed: what the ``"kvcx"`` attention runs for a KvcxCache's MLA decode steps.

transformers caches MLA's compressed latent ``c`` [B, 1, T, rank] and its shared RoPE key ``r`` [B, 1, T, rope],
then expands the whole context into per-head keys and values after the cache (``module.expand_kv``: ``kv_b_proj``
over every token, each step), and attends over those. The same attention, with ``kv_b_proj``'s weight viewed as
``W_UK`` [H, nope, rank] and ``W_UV`` [H, v, rank] (DeepSeek V2's "absorption", what vLLM's MLA backends run):

    score_h(t) = scaling (q_nope_h . W_UK_h c_t + q_rope_h . r_t) = scaling ((W_UK_h^T q_nope_h) . c_t + q_rope_h . r_t)
    out_h      = sum_t p_h(t) W_UV_h c_t = W_UV_h (sum_t p_h(t) c_t)

so the context is read once as the latent (one head of rank + rope channels for every query head) and never
expanded: per token of context H (rank + rope) + H rank products instead of rank H (nope + v) for the expansion
alone, and no [B, H, T, nope + rope] keys or [B, H, T, v] values are made.

Rounding: every product in FP32 (``kv_b_proj``'s two halves converted each step: H (nope + v) rank values, what the
model's own projections read anyway, small beside the context's products from a few hundred tokens on), the output
rounded once to the model's dtype: finer than the reference (keys and values expanded and rounded to the model's
dtype, then attended). Nothing here imports transformers.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcx.cache.scores import attention_weights

# what a module must have for the absorbed attention (transformers' MLA attention classes from 5.17 on)
_ATTRS = ("kv_b_proj", "qk_nope_head_dim", "v_head_dim", "num_heads", "expand_kv")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def unabsorbable(module, query: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> Optional[str]:
    """Why the absorbed attention cannot run for this module and these states (None: it can): a module that is not
    transformers' MLA attention, a ``kv_b_proj`` that is not a plain linear layer of float weights (a quantized
    checkpoint's: its weight is not the matrix it applies), or shapes that do not agree with it."""
    missing = [a for a in _ATTRS if not hasattr(module, a)]
    if missing:
        return f"the model's attention module has no {', '.join(missing)} (not transformers' MLA attention)"
    proj = module.kv_b_proj
    if type(proj) is not torch.nn.Linear or proj.bias is not None or proj.weight.dtype not in _FLOATS:
        return (f"kv_b_proj is a {type(proj).__name__} of {getattr(getattr(proj, 'weight', None), 'dtype', '?')} "
                "weights, not a plain linear layer of float weights without a bias")
    H, nope, dv = int(module.num_heads), int(module.qk_nope_head_dim), int(module.v_head_dim)
    rank = latent.shape[-1]
    if tuple(proj.weight.shape) != (H * (nope + dv), rank) or latent.shape[1] != 1 or rope.shape[1] != 1 \
            or tuple(query.shape[1:2]) != (H,) or query.shape[-1] != nope + rope.shape[-1]:
        return (f"the states (latent {list(latent.shape)}, rope key {list(rope.shape)}, query {list(query.shape)}) "
                f"do not fit kv_b_proj {list(proj.weight.shape)} of {H} heads ({nope} + {dv} channels)")
    return None


def absorbed_attention(module, query: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], scaling: float) -> torch.Tensor:
    """The attention output [B, Q, H, v] (in the query's dtype, as transformers' attention functions return it) of
    ``query`` [B, H, Q, nope + rope] over the latent ``latent`` [B, 1, T, rank] and RoPE key ``rope``
    [B, 1, T, rope] (every token the step attends to, its own last), with ``module.kv_b_proj`` absorbed (the
    module docstring); ``attention_mask`` [B, 1, Q, >= T] boolean (True attends) or additive, or None (the step's own
    tokens causal among them: :func:`kvcx.cache.scores.attention_weights`). The caller checked :func:`unabsorbable`."""
    H, nope, dv = int(module.num_heads), int(module.qk_nope_head_dim), int(module.v_head_dim)
    B, _, Q, _ = query.shape
    T, rank = latent.shape[-2:]
    weight = module.kv_b_proj.weight.view(H, nope + dv, rank)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]
    q_nope, q_rope = query[..., :nope], query[..., nope:]
    q_lat = torch.matmul(q_nope.float(), w_uk.float())                        # [B, H, Q, rank]: the query absorbed
    c, r = latent[:, 0].float(), rope[:, 0].float()                            # [B, T, rank], [B, T, rope]
    # every head's rows against the one latent head as one [H Q, rank] x [rank, T] product per batch row (a head
    # axis broadcast over the latent would run H products, each reading the whole context)
    scores = torch.baddbmm(torch.bmm(q_lat.reshape(B, H * Q, rank), c.transpose(1, 2)),
                           q_rope.float().reshape(B, H * Q, -1), r.transpose(1, 2))    # [B, H Q, T]
    probs = attention_weights((scores * scaling).view(B, H, Q, T), attention_mask)
    out_lat = torch.bmm(probs.reshape(B, H * Q, T), c).view(B, H, Q, rank)
    out = torch.matmul(out_lat, w_uv.float().transpose(1, 2))                  # [B, H, Q, v]
    return out.to(query.dtype).transpose(1, 2).contiguous()
