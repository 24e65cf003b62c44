"""The queries a model's attention multiplies with the keys, read where the model hands them to transformers'
attention function: after the family's own steps (a per-head or whole-width ``q_norm``, Qwen 3.5's output gate split
off ``q_proj``, the rotary embedding, Llama 4's ``qk_norm``), so that what reads them (``kvcx calibrate``'s query
weights, SnapKV's token scores) needs no copy of any model's attention code.

:func:`tapping_queries` sets the model's attention to ``"kvcx_tap"`` for a block: an implementation registered with
transformers that calls the tap with the module and the step's query and key tensors, then hands the call, unchanged,
to the implementation the model had (its own ``eager_attention_forward`` for ``"eager"``), masks included, so the
forward pass computes what it computed before. The tap and the implementation it hands to are the block's, kept per
thread; nothing is attached to the model or its modules.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kvcx.errors import KvcxError

TAP_IMPLEMENTATION = "kvcx_tap"


class _Taps(threading.local):
    """This thread's open blocks, innermost last: (tap, the implementation the model had)."""

    def __init__(self):
        self.stack = []


_TAPS = _Taps()


def _handed_to(name: str, module) -> Callable:
    """The attention function of implementation ``name`` for ``module``: the module's own eager attention for
    ``"eager"`` (each family's has its features: Gemma 2's softcap, GPT-OSS's sinks), else transformers' registry."""
    if name == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise KvcxError(f"query tap: {type(module).__name__}'s module has no eager_attention_forward; load the "
                            "model with attn_implementation='sdpa'")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def _tapped_attention(module, query, key, value, attention_mask, *args, **kwargs):
    tap, name = _TAPS.stack[-1]
    tap(module, query, key)
    return _handed_to(name, module)(module, query, key, value, attention_mask, *args, **kwargs)


def _tapped_mask(*args, **kwargs):
    return ALL_MASK_ATTENTION_FUNCTIONS[_TAPS.stack[-1][1]](*args, **kwargs)


AttentionInterface.register(TAP_IMPLEMENTATION, _tapped_attention)
AttentionMaskInterface.register(TAP_IMPLEMENTATION, _tapped_mask)


@contextlib.contextmanager
def tapping_queries(model, tap: Callable[[object, object, object], None]):
    """For the block, every attention call of ``model`` first calls ``tap(module, query, key)`` (``query``:
    ``[batch, query heads, tokens, head_dim]`` as the attention reads it; ``module.layer_idx`` names the layer),
    then runs as it did before; the model's attention implementation is restored after, on error too."""
    before = model.config._attn_implementation or "eager"
    if before == TAP_IMPLEMENTATION:   # a block inside another: hand to what the outer block hands to
        before = _TAPS.stack[-1][1]
    if before not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise KvcxError(f"query tap: the model's attention implementation {before!r} has no attention mask "
                        "function registered with transformers; load the model with attn_implementation='sdpa'")
    restore = model.config._attn_implementation
    _TAPS.stack.append((tap, before))
    try:
        model.set_attn_implementation(TAP_IMPLEMENTATION)
        yield model
    finally:
        _TAPS.stack.pop()
        model.set_attn_implementation(restore or before)
