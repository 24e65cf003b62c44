"""The ``"kvcx"`` attention implementation for transformers: SDPA, except on a KvcxCache's fused steps.

A fused step's layer is handed over from the cache to this function through :data:`HANDOFF`: the
cache posts the layer with the key tensor it returns from ``update()``; the attention function called
next with that very tensor takes it and runs the layer's fused attention over its packed store. Nothing
is attached to the tensors, and nothing flows back to the cache.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

# the attention implementation this module registers with transformers
ATTN_IMPLEMENTATION = "kvcx"
# attention arguments the fused kernel does not implement: those steps run SDPA over the materialised cache
_NOT_FUSED = frozenset(("softcap", "sliding_window", "s_aux", "position_bias"))


FUSED = "fused"


class Handoff(threading.local):
    """The fused step a cache has prepared and the attention function runs next (one per thread)."""

    def __init__(self):
        self._key = None
        self._layer = None
        self._kind = FUSED

    def post(self, key, layer, kind: str = FUSED) -> None:
        """``kind``: "fused" (the layer attends over its packed store), "press" (a press's prefill: attention
        over the step's states, then the layer keeps what its press keeps) or "tail" (a pressed layer's step:
        attention over the states given, with the layer's own causal mask)."""
        self._key, self._layer, self._kind = key, layer, kind

    def peek(self, key):
        """The layer posted with this very key tensor, left in place (for tools that watch the steps)."""
        return self._layer if self._layer is not None and key is self._key else None

    def take(self, key):
        """(the layer posted with this very key tensor, the step's kind), then forgotten; (None, None) if none."""
        if self._layer is None or key is not self._key:
            return None, None
        layer, kind, self._key, self._layer = self._layer, self._kind, None, None
        return layer, kind


PRESS, TAIL = "press", "tail"
HANDOFF = Handoff()


def needs_materialising(kwargs: dict, dropout: float, module) -> bool:
    """Whether this call asks for what the fused kernel does not do (softcap, sliding windows, attention
    sinks, position biases, training dropout)."""
    return any(kwargs.get(k) is not None for k in _NOT_FUSED) or bool(dropout and module.training)


def tail_mask(query_length: int, held: int, device) -> torch.Tensor:
    """Causal mask [1, 1, Q, held] of a step's Q tokens over a layer's ``held`` tokens, the step's own the last
    (every kept context token visible)."""
    q = torch.arange(query_length, device=device)[:, None]
    k = torch.arange(held, device=device)[None, :]
    return (k <= (held - query_length + q))[None, None]


def kvcx_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal=None, **kwargs):
    """transformers attention implementation ``"kvcx"``: SDPA, except on a KvcxCache's fused steps, where
    the layer handed over by the cache attends over its packed store."""
    layer, kind = HANDOFF.take(key)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kind == PRESS:   # the prefill, attended whole; then the layer keeps what its press keeps
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     is_causal=is_causal, **kwargs)
        layer.press_prefill(query)
        return out
    if kind == TAIL:    # held tokens after an eviction: every one visible, the step's own causal among them
        return sdpa_attention_forward(module, query, key, value, tail_mask(query.shape[-2], key.shape[-2],
                                                                           query.device),
                                      dropout=dropout, scaling=scaling, is_causal=False, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if needs_materialising(kwargs, dropout, module):
        k, v = layer.materialised_step()
        out = sdpa_attention_forward(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                     is_causal=is_causal, **kwargs)
        layer.pack_residual(layer.last_step)
        return out
    return layer.attend(query, attention_mask, scaling), None


@contextlib.contextmanager
def kvcx_attention(model):
    """The model's attention set to ``"kvcx"`` for the block, restored after (what a press in KvcxCache, or a
    cache whose layers hold uneven counts, runs under)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcx_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
