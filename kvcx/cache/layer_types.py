"""What a model's config says of each of its cache layers, read the way transformers' own caches read it.

transformers' ``DynamicCache(config=...)`` and ``StaticCache`` build one layer per entry of the decoder config's
``layer_types`` (inferred from ``sliding_window`` / ``attention_chunk_size`` where a config has none; the last
``num_kv_shared_layers`` layers have no cache of their own) and read each layer's own attributes from
``per_layer_config`` (Gemma 4's global layers have another head dim and other KV heads). :func:`layer_specs`
reads the same things into one :class:`LayerSpec` a layer, which says what kvcx does with it:

- ``full``: every token, packed;
- ``sliding``: the last ``window`` tokens (a query at position p sees (p - window, p]), packed; older blocks are
  dropped (Gemma 2/3/4, GPT-OSS, Mistral, OLMo 3, Cohere 2, Exaone 4);
- ``chunked``: the tokens of the query's chunk of ``window`` tokens (Llama 4), packed, held as a sliding layer of
  that window holds them (transformers' mask hides the previous chunk);
- ``state``: a layer with no per-token keys and values (linear attention, convolution, recurrent state: Qwen 3.5,
  Qwen3-Next, Kimi Linear; MoE/MLP placeholders): transformers' own layer class keeps it;
- ``unsupported``: a layer type kvcx cannot pack (DeepSeek V4's compressed attention, DeepSeek V3.2's indexer,
  whatever comes next): an error naming it, or transformers' own class with ``unsupported="keep"``.

Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2.5, Kimi Linear's full layers) is a ``full`` layer whose
``latent`` is set: transformers caches the compressed latent and the shared RoPE key (one "head", of two widths:
``latent_widths``) and expands them into keys and values after the cache (``kv_b_proj``), so attention never reads
what the cache returns: kvcx packs both (a codec per width) and its steps decode them (no kernel can read codes the
model multiplies before attending); under the ``"kvcx"`` attention a decode step attends over the decoded latent
with ``kv_b_proj`` absorbed (:mod:`kvcx.cache.latent`), the context never expanded. Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from kvcx.errors import KvcxError

FULL, SLIDING, CHUNKED, STATE, UNSUPPORTED = "full", "sliding", "chunked", "state", "unsupported"
# transformers' layer types -> what kvcx does with them
KINDS = {
    "full_attention": FULL,
    "sliding_attention": SLIDING,
    "chunked_attention": CHUNKED,
    # no per-token keys and values: transformers' own layer class (LinearAttentionLayer) keeps them
    "linear_attention": STATE,
    "conv": STATE,
    "moe": STATE,
    "mlp": STATE,
    "dummy": STATE,   # a layer reading another layer's keys and values, or with no attention (transformers 5.2x)
}
WINDOWED = (SLIDING, CHUNKED)
# what unsupported= takes
UNSUPPORTED_CHOICES = ("error", "keep")


@dataclass(frozen=True)
class LayerSpec:
    """One cache layer as the config describes it: its index, its type as the config names it, what kvcx does
    with it (:data:`KINDS`), its window (sliding) or chunk (chunked) in tokens, its query heads, KV heads and the
    widths of its keys and values (None where the config does not say)."""

    index: int
    type: str
    kind: str
    window: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    key_dim: Optional[int] = None
    value_dim: Optional[int] = None
    latent: bool = False   # MLA: the model expands what the cache holds before attending (never fused)
    latent_widths: Optional[tuple] = None   # MLA: (the latent's rank, the RoPE key's width) as the config gives them
    shared: bool = False   # later layers attend over what this layer's update() returns (Gemma 4's KV sharing)

    @property
    def packed(self) -> bool:
        """Whether kvcx packs this layer's keys and values."""
        return self.kind in (FULL, SLIDING, CHUNKED)

    @property
    def query_group(self) -> int:
        """Query heads a KV head serves (0 where the config does not say, they do not divide, or MLA)."""
        h, k = self.heads, self.kv_heads
        return h // k if h and k and h % k == 0 else 0

    def describe(self) -> str:
        w = f" of {self.window} tokens" if self.window else ""
        dims = (f", keys {self.key_dim} / values {self.value_dim} wide" if self.key_dim and self.value_dim
                and self.key_dim != self.value_dim else "")
        return f"layer {self.index} ({self.type}{w}{dims}{', MLA latent' if self.latent else ''})"


def text_config(config):
    """The decoder's text config of a model's config (itself where it has none)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _attr(cfg, name: str):
    """``cfg.name`` or None (a heterogeneous config raises for an attribute its layers set differently)."""
    try:
        return getattr(cfg, name, None)
    except Exception:   # transformers' AmbiguousGlobalPerLayerAttributeError, and any property that fails
        return None


def _per_layer(text, n: int) -> list:
    """The config of each of ``n`` layers: transformers' ``per_layer_config`` where it has one, else the config."""
    view = _attr(text, "per_layer_config")
    try:
        layers = list(view) if view is not None else []
    except TypeError:
        layers = []
    return layers if len(layers) >= n else [text] * n


def _positive(value, what: str, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KvcxError(f"{where}: {what} must be a positive number of tokens, got {value!r}; fix the model's "
                        "config")
    return value


def is_latent(cfg) -> bool:
    """Whether a layer's config is multi-head latent attention (a ``kv_lora_rank`` and a RoPE key part)."""
    return bool(_attr(cfg, "kv_lora_rank")) and _attr(cfg, "qk_rope_head_dim") is not None


def _dims(cfg) -> tuple:
    """(heads, kv_heads, key_dim, value_dim) of one layer's config (None for MLA: what transformers caches of the
    latent differs between its releases; the first step's tensors say)."""
    heads = _attr(cfg, "num_attention_heads")
    if is_latent(cfg):
        return heads, None, None, None
    kv = _attr(cfg, "num_key_value_heads") or heads
    hidden = _attr(cfg, "hidden_size")
    dim = _attr(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    return heads, kv, dim, dim


def layer_specs(config) -> List[LayerSpec]:
    """One :class:`LayerSpec` per cache layer of ``config`` (a model's config: its decoder text config is read),
    as transformers' ``DynamicCache(config=...)`` builds its layers. KvcxError naming the layer for a config that
    contradicts itself: ``layer_types`` of another length than the layers, a window or chunk that is not a
    positive number of tokens, a layer type that is not a string."""
    text = text_config(config)
    n = _attr(text, "num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KvcxError(f"the model's config has num_hidden_layers={n!r}; KvcxCache needs a positive layer count "
                        "(pass the model's own config)")
    types = _attr(text, "layer_types")
    per = _per_layer(text, n)
    if types is None:   # transformers infers them (get_layer_types_and_kwargs)
        types = ["sliding_attention" if _attr(c, "sliding_window") is not None else
                 "chunked_attention" if _attr(c, "attention_chunk_size") is not None else "full_attention"
                 for c in per]
    else:
        types = list(types)
        if len(types) != n:
            raise KvcxError(f"the model's config lists {len(types)} layer_types for num_hidden_layers={n}; one per "
                            "layer is needed: fix the config's layer_types (or num_hidden_layers)")
    modes = _attr(text, "kv_sharing_modes")
    n_shared = _attr(text, "num_kv_shared_layers") or 0
    owners = set()
    if isinstance(modes, (list, tuple)) and len(modes) == len(types):   # transformers 5.2x: a placeholder layer
        # for each layer reusing another's keys and values ("reuse"); "store": a layer whose states they read
        owners = {i for i, m in enumerate(modes) if m == "store"}
        types = ["dummy" if m == "reuse" else t for t, m in zip(types, modes)]
    elif n_shared:   # earlier releases: layers that reuse an earlier layer's keys and values have no cache layer;
        types = types[:n - n_shared]   # they read what the last cache layer of their type returned (Gemma 4)
        owners = {max(i for i, t in enumerate(types) if t == kind) for kind in set(types)}
    specs = []
    for i, (t, cfg) in enumerate(zip(types, per)):
        if not isinstance(t, str):
            raise KvcxError(f"layer {i}: the config's layer type {t!r} is not a name; fix the config's layer_types")
        kind = KINDS.get(t, UNSUPPORTED)
        window = None
        where = f"layer {i} ({t})"
        if kind == SLIDING:
            window = _positive(_attr(cfg, "sliding_window"), "sliding_window", where)
        elif kind == CHUNKED:
            window = _positive(_attr(cfg, "attention_chunk_size"), "attention_chunk_size", where)
        if kind in WINDOWED and window is None:
            raise KvcxError(f"{where}: the config gives this layer no "
                            f"{'sliding_window' if kind == SLIDING else 'attention_chunk_size'}; set it in the "
                            "model's config")
        heads, kv, kd, vd = _dims(cfg) if kind in (FULL, SLIDING, CHUNKED) else (None,) * 4
        latent = kind == FULL and is_latent(cfg)
        specs.append(LayerSpec(i, t, kind, window, heads, kv, kd, vd, latent=latent, shared=i in owners,
                               latent_widths=(_attr(cfg, "kv_lora_rank"), _attr(cfg, "qk_rope_head_dim"))
                               if latent else None))
    return specs


def check_unsupported(specs: List[LayerSpec], unsupported: str, cache: str = "KvcxCache") -> None:
    """KvcxError naming the first layer kvcx cannot pack, unless ``unsupported="keep"`` leaves such layers to
    transformers' own classes."""
    if unsupported not in UNSUPPORTED_CHOICES:
        raise KvcxError(f"{cache}(unsupported={unsupported!r}): use 'error' (a layer kvcx cannot pack is an error) "
                        "or 'keep' (such layers stay in transformers' own cache layer, the others are packed)")
    bad = [s for s in specs if s.kind == UNSUPPORTED]
    if bad and unsupported == "error":
        names = ", ".join(f"{s.index} ({s.type})" for s in bad[:4]) + (", ..." if len(bad) > 4 else "")
        raise KvcxError(f"{cache}: {'layers' if len(bad) > 1 else 'layer'} {names} "
                        f"{'are layer types' if len(bad) > 1 else 'is a layer type'} kvcx cannot pack (it packs "
                        f"{', '.join(sorted(t for t, k in KINDS.items() if k != STATE))} layers and keeps "
                        f"{', '.join(sorted(t for t, k in KINDS.items() if k == STATE))} layers' states as "
                        f"transformers does); pass {cache}(..., unsupported='keep') to leave such layers to "
                        "transformers' own cache layer and pack the others")


def cached_layers(config) -> tuple:
    """((layer index, layer type), ...) of the layers whose keys and values a model's cache holds, as its config
    describes them (:func:`layer_specs`): every layer of a dense model; a hybrid's attention layers (full,
    sliding, chunked), not its linear-attention or placeholder layers. KvcxError for a config with none."""
    out = tuple((s.index, s.type) for s in layer_specs(config) if s.packed)
    if not out:
        raise KvcxError("the model's config gives no layer with keys and values (its layer_types have no full, "
                        "sliding or chunked attention layer): there is no cache to compress or plan")
    return out


def refuse_press(config, whole_model: bool) -> None:
    """KvcxError where a press (token eviction: scheme ``kvcx+snapkv:0.5`` and the like) cannot run on this model:
    an MLA layer anywhere (its cache holds one latent a token that every head reads through ``kv_b_proj``, not keys
    per KV head, which the presses score and evict); and, where the press evicts from every layer
    (``whole_model``: the gate's prefix and retrieval copies of the cache, ``kvcx calibrate``), a hybrid's sliding,
    chunked or linear-attention layers. KvcxCache presses its full-attention layers only; its windows hold theirs."""
    specs = layer_specs(config)
    latent = [s for s in specs if s.latent]
    if latent:
        raise KvcxError(f"a press scores and evicts each KV head's keys, and layer {latent[0].index} is multi-head "
                        "latent attention (MLA: one latent a token, read by every head through kv_b_proj): compress "
                        "its cache without a press (scheme 'kvcx', or a plan without one)")
    if whole_model:
        refuse_press_on_hybrid([(s.index, s.type) for s in specs if s.type != "full_attention"])


def refuse_press_on_hybrid(layer_types) -> None:
    """KvcxError for a press that evicts from every layer (the gate's copies of the cache, ``kvcx calibrate``, a
    plan's press) on a hybrid model; ``layer_types``: its (layer, type) pairs that are not full attention (empty for
    a dense model: no error)."""
    if layer_types:
        named = ", ".join(f"{L} {t}" for L, t in list(layer_types)[:8]) + (", ..." if len(layer_types) > 8 else "")
        raise KvcxError(f"a press evicts tokens from every layer's keys and values here, and this is a hybrid model "
                        f"({named}; sliding windows and linear states are not evicted): run it without a press, or "
                        "in KvcxCache (kvcx validate --mode generation), which presses the full-attention layers only")
