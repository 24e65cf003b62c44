"""The ``"kvcx"`` attention implementation for transformers, and the contract between a kvcx cache layer and it.

transformers' attention layers call ``past_key_values.update(keys, values, layer_idx)`` and hand what it returns to
the attention function. A kvcx cache layer that runs a step fused cannot return the context's keys and values (it
holds them packed), so the step goes through one mechanism, the same for every layer kind (full, sliding, chunked,
the static cache's):

1. the layer's ``update()`` returns the step's own states and *posts* itself to :data:`HANDOFF` with the key
   tensor it returns (:meth:`Handoff.post`);
2. the ``"kvcx"`` attention function called with that very tensor finds the layer (:meth:`Handoff.take`: matched
   by identity; nothing is attached to the tensors) and calls the layer's :meth:`FusedStep.attend` with the step's
   queries, mask, scaling and the attention features the model asks for (``softcap``, ``s_aux`` sinks), which
   returns the attention output ``[B, Q, Hq, Dv]``;
3. nothing flows back to the cache but through the layer's own methods.

A fused step stays posted until its layer posts its next one, so that layers sharing another layer's keys and
values (Gemma 4's KV-shared layers hand the owner's returned tensors to their own attention) attend over the
owner's packed store with their own queries. A press's prefill and an evicted layer's step (``"press"``,
``"tail"``) are taken once. Steps the fused kernel cannot run (a layer that decodes its store: 8-bit codes,
``fused=False``) never post: ``update()`` returns the materialised context, as transformers' layers do, and the
attention is the reference one below.

MLA (``"latent"``, taken once): transformers expands what the cache returns (the latent and the RoPE key) into
keys and values before it calls the attention function, so the key tensor that arrives is not the one the layer
returned. A latent layer's decode step returns the step's own latent (the model expands that token alone) and is
found by the attention module's ``layer_idx``; the attention runs over the layer's decoded latent with the model's
``kv_b_proj`` absorbed (:mod:`kvcx.cache.latent`: the context is never expanded), or, for a module it does not
fit, over the latent expanded by the module's own ``expand_kv``.

The reference attention (steps with no posted layer) is SDPA, except where the model asks for what SDPA does not
do, logit softcapping and per-head sinks: those run in :func:`eager_attention` (FP32 softmax), as the models' own
eager attention does.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Optional, Protocol

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from kvcx.cache import latent
from kvcx.cache.scores import attention_weights, tail_mask
from kvcx.errors import KvcxError

# the attention implementation this module registers with transformers
ATTN_IMPLEMENTATION = "kvcx"
# attention arguments the fused kernels do not implement: those steps run the reference over the materialised cache
_NOT_FUSED = frozenset(("position_bias",))
# attention arguments SDPA does not implement (transformers' sdpa_attention_forward ignores them)
_EAGER = ("softcap", "s_aux")

FUSED, PRESS, TAIL, LATENT = "fused", "press", "tail", "latent"


class FusedStep(Protocol):
    """What a cache layer posts for a fused step: :meth:`attend` runs the step's attention over what the layer
    holds; :meth:`materialised_step` gives the held keys and values instead (a step asking for what the kernels
    do not do), and :meth:`after_materialised` lets the layer finish such a step."""

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float, *,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
               sliding_window: Optional[int] = None) -> torch.Tensor:
        """The step's attention output [B, Q, Hq, Dv] in the query's dtype: ``query`` [B, Hq, Q, D] over the held
        tokens and the step's own (causal among them), ``attention_mask`` as transformers built it for this layer
        (or None), scores scaled by ``scaling``, capped by ``softcap``, with ``sinks`` [Hq] in the softmax's sum;
        ``sliding_window``: the window the model's attention layer names (checked against the layer's)."""

    def materialised_step(self):
        """(keys, values) of every token the step attends to, materialised."""

    def after_materialised(self) -> None:
        """Called after the attention of a materialised step."""


class LatentStep(Protocol):
    """What an MLA cache layer posts for a decode step (kind ``"latent"``); ``unexpandable_fix``: what to build
    instead when the model's MLA module can neither be absorbed nor expand the latent (the error's advice)."""

    unexpandable_fix: str

    def latent_states(self, attention_mask):
        """(latent [B, 1, T, rank], RoPE key [B, 1, T, rope], mask) of every token the step attends to, decoded;
        the mask the attention applies: transformers' ``attention_mask`` as given, or the layer's own where its
        tokens are not in transformers' order (StaticKvcxCache's rows: :mod:`kvcx.cache.static_latent`)."""

    def after_latent(self, absorbed: bool) -> None:
        """Called after the step's attention (``absorbed``: over the latent, else over the module's expansion)."""


class Handoff(threading.local):
    """The steps kvcx cache layers have posted for the attention function (one set per thread), keyed by the layer
    index they posted at; the most recent first when matching a key tensor. A layer is held weakly: a cache the
    caller has dropped is not kept alive by its last posted step."""

    def __init__(self):
        self._steps = {}   # layer index -> (key tensor, weak reference to the layer, kind)

    def post(self, key, layer, kind: str = FUSED) -> None:
        """``kind``: "fused" (the layer attends over its packed store: :class:`FusedStep`), "press" (a press's
        prefill: attention over the step's states, then the layer keeps what its press keeps), "tail" (a pressed
        layer's step: attention over the states given, with the layer's own causal mask) or "latent" (an MLA
        layer's step: :class:`LatentStep`, found by :meth:`take_latent`). Replaces what the same layer index
        posted before (and moves it last: the most recent)."""
        idx = getattr(layer, "layer_idx", None)
        self._steps.pop(idx, None)
        self._steps[idx] = (key, weakref.ref(layer), kind)

    def _find(self, key):
        for idx in reversed(self._steps):
            k, ref, kind = self._steps[idx]
            if k is key:
                layer = ref()
                return (idx, layer, kind) if layer is not None else (None, None, None)
        return None, None, None

    def peek(self, key):
        """The layer posted with this very key tensor, left in place (for tools that watch the steps)."""
        return self._find(key)[1]

    def take(self, key):
        """(the layer posted with this very key tensor, the step's kind); (None, None) if none. A fused step stays
        posted (a KV-shared layer may attend over it too); a press or tail step is forgotten."""
        idx, layer, kind = self._find(key)
        if layer is not None and kind != FUSED:
            del self._steps[idx]
        return layer, kind

    def take_latent(self, module):
        """The MLA layer posted at the attention ``module``'s ``layer_idx`` (kind "latent"), forgotten once taken;
        None if none."""
        return self.drop_latent(getattr(module, "layer_idx", None))

    def drop_latent(self, idx):
        """Forget the "latent" step layer ``idx`` posted, if any, and return its layer (None if none). A layer calls
        it on its steps that post none, so that the module of that index never finds an earlier step's that no
        attention took."""
        entry = self._steps.get(idx) if idx is not None else None
        if entry is None or entry[2] != LATENT:
            return None
        del self._steps[idx]
        return entry[1]()

    def clear(self) -> None:
        """Forget every posted step (a cache being reset)."""
        self._steps.clear()


HANDOFF = Handoff()


def needs_materialising(kwargs: dict, dropout: float, module) -> bool:
    """Whether this call asks for what the fused kernels do not do (position biases, training dropout)."""
    return any(kwargs.get(k) is not None for k in _NOT_FUSED) or bool(dropout and module.training)


def eager_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                    softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """Attention with logit softcapping (Gemma 2: scores s -> softcap tanh(s / softcap) before the mask) and
    per-head sinks (GPT-OSS's ``s_aux``: a logit per query head in the softmax's sum, attending to nothing), in
    FP32 as the models' eager attention computes its softmax: what SDPA does not do. Keys may be wider than the
    values (MLA). Returns ([B, Q, Hq, Dv] in the query's dtype, None)."""
    Hq, D = query.shape[1], query.shape[-1]
    groups = Hq // key.shape[1]
    k, v = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query.float(), k.float().transpose(2, 3)) * (D ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = attention_weights(scores, attention_mask, s_aux)
    if dropout and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    out = torch.matmul(probs, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def reference_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: Optional[float] = None, is_causal=None, **kwargs):
    """The attention of a step with no posted layer (or a materialised one): SDPA, or :func:`eager_attention`
    where the model asks for softcapping or sinks (SDPA itself takes values narrower than the keys: MLA)."""
    if any(kwargs.get(k) is not None for k in _EAGER):
        return eager_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def kvcx_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal=None, **kwargs):
    """transformers attention implementation ``"kvcx"``: the reference attention, except on a kvcx cache's fused
    steps, where the layer posted with ``key`` attends over what it holds (the module's docstring)."""
    layer, kind = HANDOFF.take(key)
    if layer is None:
        latent_layer = HANDOFF.take_latent(module)
        if latent_layer is not None:
            return latent_attention(module, latent_layer, query, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=is_causal, **kwargs)
        return reference_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, **kwargs)
    if kind == PRESS:   # the prefill, attended whole; then the layer keeps what its press keeps
        out = reference_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
        layer.press_prefill(query)
        return out
    if kind == TAIL:    # held tokens after an eviction: every one visible, the step's own causal among them
        return reference_attention(module, query, key, value, tail_mask(query.shape[-2], key.shape[-2],
                                                                         query.device),
                                   dropout=dropout, scaling=scaling, is_causal=False, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if needs_materialising(kwargs, dropout, module):
        k, v = layer.materialised_step()
        out = reference_attention(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
        layer.after_materialised()
        return out
    sinks = kwargs.get("s_aux")
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise KvcxError(f"the model's attention gave s_aux of type {type(sinks).__name__}; kvcx reads a tensor of "
                        "one sink logit per query head")
    return layer.attend(query, attention_mask, scaling, softcap=kwargs.get("softcap"), sinks=sinks,
                        sliding_window=kwargs.get("sliding_window")), None


def latent_attention(module, layer, query, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                     is_causal=None, **kwargs):
    """An MLA layer's decode step (kind "latent"): attention over the layer's decoded latent with the module's
    ``kv_b_proj`` absorbed (:func:`kvcx.cache.latent.absorbed_attention`), or, where that does not fit the module
    (:func:`~kvcx.cache.latent.unabsorbable`) or the call asks for what it does not do, the reference attention over
    the latent expanded by the module's own ``expand_kv``."""
    latent_states, rope, attention_mask = layer.latent_states(attention_mask)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    plain = not needs_materialising(kwargs, dropout, module) and all(kwargs.get(k) is None for k in _EAGER)
    why = latent.unabsorbable(module, query, latent_states, rope) if plain else \
        "the model's attention asks for what the absorbed attention does not do (softcap, sinks, biases, dropout)"
    if why is None:
        out = latent.absorbed_attention(module, query, latent_states, rope, attention_mask, scaling)
        layer.after_latent(absorbed=True)
        return out, None
    if not callable(getattr(module, "expand_kv", None)):
        raise KvcxError(f"KvcxCache layer {getattr(module, 'layer_idx', '?')}: the model's MLA attention "
                        f"({type(module).__name__}) cannot be absorbed ({why}) and has no expand_kv to expand the "
                        f"cached latent with; {layer.unexpandable_fix}")
    key, value = module.expand_kv(latent_states, rope)
    out = reference_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)
    layer.after_latent(absorbed=False)
    return out


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
@functools.lru_cache(maxsize=None)
def _eager_only(config_class: type) -> bool:
    """Whether transformers' model of this config class runs eager attention only (its class declares no SDPA:
    DeepSeek V4). Such a model may build on the float mask eager gives it: V4 concatenates its compressor's additive
    bias (0 / -inf) onto the mask, which a boolean mask would read inverted."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return not getattr(MODEL_MAPPING[config_class], "_supports_sdpa", True)
    except (KeyError, ValueError):   # a config with no base model in the auto mapping: the SDPA mask
        return False


def _model_code_reads_mask(config) -> bool:
    """Whether layers kvcx leaves to the model (a layer type kvcx cannot pack, kept with ``unsupported="keep"``) run
    an eager-only model's own code on the mask: that code is written for eager's float mask (DeepSeek V4 concatenates
    its compressor's additive bias onto it, which a boolean mask would read inverted)."""
    from kvcx.cache.layer_types import UNSUPPORTED, layer_specs

    if not _eager_only(type(config)):
        return False
    try:
        return any(s.kind == UNSUPPORTED for s in layer_specs(config))
    except KvcxError:   # a config kvcx cannot read: KvcxCache says why at construction
        return False


def kvcx_mask(*args, config=None, **kwargs):
    """The masks the ``"kvcx"`` attention reads: SDPA's (boolean, or none where causal is enough: what the fused
    kernels and StaticKvcxCache's steps take), or eager's float mask where the model's own code reads the mask
    (:func:`_model_code_reads_mask`); the reference attention and the fused kernels take either."""
    mask_fn = eager_mask if config is not None and _model_code_reads_mask(config) else sdpa_mask
    return mask_fn(*args, config=config, **kwargs)


AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcx_mask)
