"""Attention scores to weights as kvcx's reference attention computes them, in FP32: transformers' mask (boolean,
True attends, or additive), the step's own tokens causal among them where no mask is given, per-head sinks in the
softmax's sum, a row that sees nothing weighing nothing. Shared by the eager attention of
:mod:`kvcx.cache.attention_fn` and MLA's absorbed attention (:mod:`kvcx.cache.latent`). Nothing here imports
transformers."""
from __future__ import annotations

from typing import Optional

import torch


def tail_mask(query_length: int, held: int, device) -> torch.Tensor:
    """Causal mask [1, 1, Q, held] of a step's Q tokens over a layer's ``held`` tokens, the step's own the last
    (every kept context token visible)."""
    q = torch.arange(query_length, device=device)[:, None]
    k = torch.arange(held, device=device)[None, :]
    return (k <= (held - query_length + q))[None, None]


def attention_weights(scores: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The softmax of ``scores`` [B, Hq, Q, T] (FP32) under ``attention_mask`` [B, 1, Q, >= T] (its first T columns;
    None: :func:`tail_mask`'s for a step of several tokens), with ``sinks`` [Hq] (a logit a query head in the sum,
    attending to nothing) or None; NaN rows (a row that sees nothing) are zeros, as SDPA's masked rows."""
    B, Hq, Q, T = scores.shape
    if attention_mask is not None:
        m = attention_mask[:, :, :, :T]
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    elif Q > 1:
        scores = scores.masked_fill(~tail_mask(Q, T, scores.device), float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, Hq, 1, 1).expand(B, Hq, Q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)
