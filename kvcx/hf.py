"""KvcxCache: a transformers cache that keeps the KV cache packed in kvcx's INT4 format.

    import kvcx.hf                              # registers the "kvcx" attention implementation
    from kvcx.hf import KvcxCache
    model.set_attn_implementation("kvcx")      # decode steps read the packed codes (the fused kernel)
    cache = KvcxCache(model.config, group_size=64, residual_length=64)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    cache.memory_report()

Design (transformers' quantized-cache design, with appending instead of re-quantizing):
each layer keeps a short full-precision residual of at most ``residual_length``
tokens. When it fills, whole multiples of ``residual_length`` tokens are encoded
by the Cython kernels and appended to the layer's packed store
(:class:`kvcx.attention.PackedKV`: codes + FP16 scales + zero points, the exact
sink tokens) and dropped from the residual. Nothing is stored dequantized.

Attention over the store takes one of two paths per layer step:

- fused (single-token steps on CPU, the model's attention set to ``"kvcx"``): the
  cache returns the new token's keys marked with the layer, and the ``"kvcx"``
  attention function runs the fused kernel over the packed store, the sinks and
  the residual (kvcx/_attn.h); no full-precision copy of the context exists;
- materialising (prefill chunks, ``fused=False``, other attention implementations,
  CUDA): the layer decodes its packed store into one scratch buffer shared by all
  layers and hands ``[decoded, residual, new]`` to attention (on CUDA the decoded
  scratch is copied to the device; the kernels are CPU kernels).

The ``"kvcx"`` attention implementation is SDPA for every call that is not a
KvcxCache fused step. torch and transformers are imported when this module is
imported; the rest of kvcx never imports it unless asked.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from kvcx.attention import NO_MASK, PackedKV, Workspace
from kvcx.codec import codec_from_config, decode_packed
from kvcx.deps import check_transformers_version
from kvcx.errors import KvcxError
from kvcx.kv_cache import torch_to_numpy
from kvcx.kvconfig import DEFAULT_SCHEME, KVConfig
from kvcx.runtime import resolve_threads

check_transformers_version(transformers.__version__)

# the attention implementation this module registers with transformers
ATTN_IMPLEMENTATION = "kvcx"

class _Scratch:
    """Growable full-precision buffers, one for keys and one for values, shared by every layer."""

    def __init__(self):
        self.host = {}
        self.device = {}

    def get(self, kind: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device):
        n = int(np.prod(shape))
        buf = self.host.get(kind)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            cap = max(n, int(n * 1.5))
            buf = torch.empty(cap, dtype=dtype, pin_memory=device.type == "cuda" and torch.cuda.is_available())
            self.host[kind] = buf
        host = buf[:n].view(shape)
        if device.type == "cpu":
            return host, host
        dbuf = self.device.get(kind)
        if dbuf is None or dbuf.numel() < n or dbuf.dtype != dtype or dbuf.device != device:
            dbuf = torch.empty(max(n, int(n * 1.5)), dtype=dtype, device=device)
            self.device[kind] = dbuf
        return host, dbuf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for d in (self.host, self.device) for b in d.values())

    def release(self) -> None:
        if self.host or self.device:
            self.host.clear()
            self.device.clear()


class KvcxLayer(DynamicLayer):
    """One layer of a :class:`KvcxCache`."""

    is_compileable = False

    def __init__(self, kv_config: KVConfig, residual_length: int, scratch: _Scratch, owner: "KvcxCache",
                 key_weights: Optional[np.ndarray] = None):
        super().__init__()
        self.kv_config = kv_config
        self.residual_length = residual_length
        self._scratch = scratch
        self._owner = owner
        first = {"key": kv_config.key, "value": kv_config.value}
        self._codecs_first = first
        # later chunks: the same codecs without sinks, and with the same threads
        self._codecs_next = {k: codec_from_config({**c.get_config(), "sinks": 0}).with_threads(c.n_threads)
                             for k, c in first.items()}
        self._key_weights = key_weights  # per-channel widths: how much the queries weigh each key channel
        self.n_threads = kv_config.value.n_threads
        self.store: Optional[PackedKV] = None
        self.cumulative_length = 0
        self.steps = {"fused": 0, "materialised": 0, "full_precision": 0}
        self._unsupported: Optional[str] = None

    @property
    def quantized_length(self) -> int:
        """Tokens held packed (exact sink tokens included)."""
        return self.store.tokens if self.store is not None else 0

    # -- storage -------------------------------------------------------------
    def _encode(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        codecs = self._codecs_first if not len(self.store) else self._codecs_next
        t = time.perf_counter()
        pk = codecs["key"].encode(torch_to_numpy(keys), name="key", weights=self._key_weights)
        pv = codecs["value"].encode(torch_to_numpy(values), name="value")
        self.store.append(pk, pv)
        self._owner.kernel_time_s += time.perf_counter() - t
        self._unsupported = self.store.unsupported(self.store.keys.D, self._owner.query_group)

    def _flush(self) -> None:
        """Pack the residual's whole multiples of residual_length tokens."""
        n_res = self.keys.shape[-2]
        if n_res >= self.residual_length:
            n_flush = (n_res // self.residual_length) * self.residual_length
            self._encode(self.keys[:, :, :n_flush], self.values[:, :, :n_flush])
            self.keys = self.keys[:, :, n_flush:].contiguous()
            self.values = self.values[:, :, n_flush:].contiguous()

    def _materialize(self, new_k: Optional[torch.Tensor], new_v: Optional[torch.Tensor]):
        """[dequantized chunks, residual, new tokens] for attention, in the shared scratch buffers."""
        B, H, _, D = self.keys.shape
        n_res = self.keys.shape[-2]
        n_new = new_k.shape[-2] if new_k is not None else 0
        total = self.quantized_length + n_res + n_new
        out = []
        for kind, res, new in (("key", self.keys, new_k), ("value", self.values, new_v)):
            store = self.store.keys if kind == "key" else self.store.values
            host, dev = self._scratch.get(kind, (B, H, total, D), self.dtype, self.device)
            arr = torch_to_numpy(host)  # a view: decoding writes straight into the scratch
            t = time.perf_counter()
            off = 0
            for p in store.spans():
                decode_packed(p, out=arr, token_offset=off, name=kind, n_threads=self.n_threads)
                off += p.shape[-2]
            self._owner.kernel_time_s += time.perf_counter() - t
            if dev is not host:
                dev[:, :, :off].copy_(host[:, :, :off])
            dev[:, :, off:off + n_res] = res
            if n_new:
                dev[:, :, off + n_res:] = new
            out.append(dev)
        return out[0], out[1]

    # -- transformers API --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise KvcxError(f"KvcxCache holds float32/float16/bfloat16 caches, got {key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.keys = key_states.new_empty((B, H, 0, D))
        self.values = value_states.new_empty((B, H, 0, D))
        self.store = PackedKV(B * H, D, self._codecs_first["key"], self._codecs_first["value"],
                              workspace=self._owner._workspace)
        self._unsupported = self.store.unsupported(D, self._owner.query_group)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._flush()  # a fused step packs after its attention; anything left over goes now
        self.cumulative_length += key_states.shape[-2]
        if key_states.shape[-2] == 1 and self._owner._fused_step(self, key_states):
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.steps["fused"] += 1
            marker = key_states.view_as(key_states)  # kvcx attention finds this layer on it and reads the store
            marker._kvcx_layer = self
            return marker, value_states
        if len(self.store):
            keys_out, values_out = self._materialize(key_states, value_states)
            self.steps["materialised"] += 1
        else:
            keys_out = torch.cat([self.keys, key_states], dim=-2)
            values_out = torch.cat([self.values, value_states], dim=-2)
            self.steps["full_precision"] += 1
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._flush()
        return keys_out, values_out

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float) -> torch.Tensor:
        """The fused step: one query token per row against the packed store and the residual.

        Returns the attention output as transformers' attention functions do: [B, 1, Hq, D]."""
        # every step of every layer comes here: the arrays are built to the kernel's contract (float32,
        # C-contiguous, the shapes PackedKV.step checks), so the step skips PackedKV.attend's type checks
        B, Hq, _, D = query.shape
        fp32 = query.dtype == torch.float32
        q = (query if fp32 else query.float()).contiguous().numpy().reshape(B, Hq, D)
        keys, values = (self.keys, self.values) if self.keys.dtype == torch.float32 else \
            (self.keys.float(), self.values.float())
        N, nr = B * keys.shape[1], keys.shape[2]
        rk, rv = keys.numpy().reshape(N, nr, D), values.numpy().reshape(N, nr, D)
        if attention_mask is None:
            mask = NO_MASK
        else:
            mask = self._owner._additive_mask(attention_mask, B)
            if mask.shape[-1] != self.cumulative_length:
                raise KvcxError(f"the attention mask covers {mask.shape[-1]} tokens but the cache holds "
                                f"{self.cumulative_length}; pass the mask generate() builds")
        out = np.empty((B, 1, Hq, D), dtype=np.float32)
        t = time.perf_counter()
        self.store.step(q, rk, rv, mask, scaling, resolve_threads(self.n_threads), out.reshape(B, Hq, D))
        self._owner.kernel_time_s += time.perf_counter() - t
        self._flush()
        out = torch.from_numpy(out)
        return out if fp32 else out.to(query.dtype)

    def full_states(self):
        """Keys and values of every held token, materialised (for attention features the kernel lacks)."""
        return self._materialize(None, None)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.store = None
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise KvcxError("KvcxCache cannot be cropped (packed chunks are append-only); use DynamicCache for "
                        "assisted or speculative decoding")

    def reorder_cache(self, beam_idx) -> None:
        raise KvcxError("KvcxCache does not support beam search yet; use greedy or sampling decoding")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KvcxError("KvcxCache does not support batch expansion (num_return_sequences > 1 / beam search)")

    def batch_select_indices(self, indices) -> None:
        raise KvcxError("KvcxCache does not support selecting batch rows")

    # -- accounting -----------------------------------------------------------
    def packed_bytes(self) -> int:
        """Bytes of the packed store (codes, scales, zero points, sinks, the head rows attention reads)."""
        return self.store.nbytes if self.store is not None else 0

    def residual_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()


# attention arguments the fused kernel does not implement: those steps run SDPA over the materialised cache
_NOT_FUSED = frozenset(("softcap", "sliding_window", "s_aux", "position_bias"))


def kvcx_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers attention implementation ``"kvcx"``: SDPA, except on a KvcxCache's single-token steps,
    where the fused kernel reads the packed cache (the cache marks those steps' key states)."""
    layer = getattr(key, "_kvcx_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if ((not _NOT_FUSED.isdisjoint(kwargs) and any(kwargs.get(k) is not None for k in _NOT_FUSED))
            or (dropout and module.training)):  # what the kernel does not do: SDPA over the materialised cache
        layer.steps["fused"] -= 1
        layer.steps["materialised"] += 1
        k, v = layer.full_states()
        out = sdpa_attention_forward(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                     is_causal=is_causal, **kwargs)
        layer._flush()
        return out
    return layer.attend(query, attention_mask, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcx_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


class KvcxCache(Cache):
    """A packed INT4 KV cache for ``model.generate(..., past_key_values=KvcxCache(model.config))``.

    Parameters
    ----------
    config: the model's config (its decoder text config is used for the layer count).
    group_size, scheme, bits, sinks, rotate: the codec, as for ``kvcx compress`` (default: the kvcx scheme).
    residual_length: tokens kept in full precision before they are packed (a multiple of the
        group size when keys are grouped per channel).
    kv_config: a ready :class:`kvcx.kvconfig.KVConfig` instead of the options above.
    n_threads: OpenMP threads of the kernels (None = all).
    fused: None (default): single-token steps run the fused kernel when the model's attention is
        ``"kvcx"`` and the codecs allow it, else the materialising path; False: always materialise;
        True: a step that cannot run fused is an error.
    """

    def __init__(self, config, group_size: int = 64, scheme: str = DEFAULT_SCHEME, residual_length: int = 64,
                 bits: Optional[int] = None, sinks: Optional[int] = None, rotate: Optional[bool] = None,
                 kv_config: Optional[KVConfig] = None, n_threads: Optional[int] = None,
                 fused: Optional[bool] = None):
        kv = kv_config or KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate,
                                               n_threads=n_threads)
        if kv_config is not None and n_threads is not None:  # n_threads applies to a ready config too
            kv = kv.with_threads(n_threads)
        if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 1:
            raise KvcxError(f"residual_length must be a positive integer, got {residual_length!r}")
        for c in (kv.key, kv.value):
            if c.axis == "channel" and residual_length % c.group_size:
                raise KvcxError(f"residual_length ({residual_length}) must be a multiple of the group size "
                                f"({c.group_size}) when grouping per channel, so every packed group is full")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        bad = set(layer_types) - {"full_attention"}
        if bad:
            raise KvcxError(f"KvcxCache supports full-attention models only; this model has {sorted(bad)} layers")
        if fused not in (None, True, False):
            raise KvcxError(f"fused must be None (automatic), True or False, got {fused!r}")
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.kv_config = kv
        self.residual_length = residual_length
        self.fused = fused
        self.query_group = heads // kv_heads if heads and kv_heads and heads % kv_heads == 0 else 0
        self._config = text
        self.kernel_time_s = 0.0
        self._scratch = _Scratch()
        self._workspace = Workspace()  # the fused kernel's scratch, one for all layers
        self._mask_cache = None         # (the step's mask tensor, its additive float32 form)
        self._uses_kvcx: Optional[bool] = None  # the model attention is kvcx's (read at each step's first layer)
        super().__init__(layers=[KvcxLayer(kv.for_layer(i), residual_length, self._scratch, self,
                                           kv.weights_for(f"layer_{i}_key"))
                                 for i in range(text.num_hidden_layers)])

    def _additive_mask(self, attention_mask: torch.Tensor, B: int) -> np.ndarray:
        """The last query row of transformers' mask as float32 [B, kv_len] added to the scores (0 or -inf):
        converted once per step, as every layer of a step gets the same mask tensor."""
        if self._mask_cache is not None and self._mask_cache[0] is attention_mask:
            return self._mask_cache[1]
        m = attention_mask.detach()
        if m.dim() == 4:
            m = m[:, 0, -1]
        elif m.dim() == 3:
            m = m[:, -1]
        if m.shape[0] != B:
            m = m.expand(B, m.shape[-1])
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
        mask = m.to(torch.float32).contiguous().numpy()
        self._mask_cache = (attention_mask, mask)  # holds the tensor, so its identity stays its own
        return mask

    def _fused_step(self, layer: KvcxLayer, key_states: torch.Tensor) -> bool:
        """Whether this single-token step of `layer` runs the fused kernel (the model's attention is kvcx's)."""
        if self.fused is False:
            return False
        if layer is self.layers[0] or self._uses_kvcx is None:  # read once per step (a config attribute is slow)
            self._uses_kvcx = getattr(self._config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
        uses_kvcx = self._uses_kvcx
        why = layer._unsupported or (None if key_states.device.type == "cpu" else
                                     "fused attention runs on CPU tensors")
        if self.fused and not uses_kvcx:
            raise KvcxError(f"KvcxCache(fused=True) needs the model's attention to be {ATTN_IMPLEMENTATION!r}: "
                            f"load it with attn_implementation={ATTN_IMPLEMENTATION!r} or call "
                            f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (after importing kvcx.hf)")
        if self.fused and why:
            raise KvcxError(f"KvcxCache(fused=True): {why}; pass fused=None to fall back to materialising")
        if not uses_kvcx or why:
            return False
        self._scratch.release()  # fused steps need no full-precision copy of the context
        return True

    def memory_report(self) -> dict:
        """Bytes the cache holds, counted whole: packed stores + full-precision residual + the
        materialising path's full-precision scratch (released by fused steps) and the last step's
        attention mask (scratch_bytes) + the fused kernel's workspace (a few KiB per task, shared by
        the layers).

        ``attention_steps``: layer steps per path (fused kernel, materialised scratch, or all full precision)."""
        packed = sum(layer.packed_bytes() for layer in self.layers)
        residual = sum(layer.residual_bytes() for layer in self.layers)
        scratch = self._scratch.nbytes()
        if self._mask_cache is not None:  # the last step's mask and its float form
            t, m = self._mask_cache
            scratch += m.nbytes + t.numel() * t.element_size()
        workspace = self._workspace.nbytes
        values = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, D = layer.keys.shape
                values += 2 * B * H * layer.cumulative_length * D
        steps = {k: sum(layer.steps[k] for layer in self.layers) for k in ("fused", "materialised", "full_precision")}
        return {"packed_bytes": packed, "residual_bytes": residual, "scratch_bytes": scratch,
                "workspace_bytes": workspace, "total_bytes": packed + residual + scratch + workspace,
                "tokens": self.get_seq_length(),
                "attention_steps": steps,
                "fp16_equivalent_bytes": 2 * values,
                "model_dtype_equivalent_bytes": values * (self.layers[0].dtype.itemsize
                                                          if self.layers and self.layers[0].is_initialized else 2),
                "bits_per_value": 8.0 * (packed + residual) / values if values else 0.0}

    def nbytes(self) -> int:
        return self.memory_report()["total_bytes"]


def dynamic_cache_bytes(cache) -> int:
    """Bytes held by a transformers DynamicCache (keys + values of every layer)."""
    from kvcx.kv_cache import cache_layers

    return int(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache_layers(cache)))
