"""KvcxCache: a transformers cache that keeps the KV cache packed in kvcx's INT4 format.

    from kvcx.hf import KvcxCache
    cache = KvcxCache(model.config, group_size=64, residual_length=128)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    cache.memory_report()

Design (transformers' quantized-cache design, with appending instead of re-quantizing):
each layer keeps a short full-precision residual of at most ``residual_length``
tokens. When it fills, whole multiples of ``residual_length`` tokens are encoded
by the Cython kernels into a new packed chunk (codes + FP16 scales + zero points,
the first chunk also holds the exact sink tokens) and dropped from the residual.
Chunks are never dequantized into stored copies: at every step the layer decodes
its chunks straight into one scratch buffer shared by all layers (one layer's
keys and values in full precision), appends the residual and the new tokens, and
hands that to attention. Packed data lives on the CPU; on CUDA the decoded
scratch is copied to the device (the kernels are CPU kernels).

torch and transformers are imported when this module is imported; the rest of
kvcx never imports it unless asked.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

from kvcx.codec import IntCodec, Packed, decode_packed
from kvcx.deps import check_transformers_version
from kvcx.errors import KvcxError
from kvcx.kv_cache import torch_to_numpy
from kvcx.kvconfig import DEFAULT_SCHEME, KVConfig

check_transformers_version(transformers.__version__)

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


class KvcxLayer(DynamicLayer):
    """One layer of a :class:`KvcxCache`."""

    is_compileable = False

    def __init__(self, kv_config: KVConfig, residual_length: int, scratch: _Scratch, owner: "KvcxCache"):
        super().__init__()
        self.kv_config = kv_config
        self.residual_length = residual_length
        self._scratch = scratch
        self._owner = owner
        first = {"key": kv_config.key, "value": kv_config.value}
        self._codecs_first = first
        # later chunks: the same codecs without sinks, and with the same threads
        self._codecs_next = {k: IntCodec.from_config({**c.get_config(), "sinks": 0}).with_threads(c.n_threads)
                             for k, c in first.items()}
        self.n_threads = kv_config.value.n_threads
        self.chunks: List[Tuple[Packed, Packed]] = []
        self.quantized_length = 0
        self.cumulative_length = 0

    # -- storage -------------------------------------------------------------
    def _encode(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        codecs = self._codecs_first if not self.chunks else self._codecs_next
        t = time.perf_counter()
        pk = codecs["key"].encode(torch_to_numpy(keys), name="key")
        pv = codecs["value"].encode(torch_to_numpy(values), name="value")
        self._owner.kernel_time_s += time.perf_counter() - t
        self.chunks.append((pk, pv))
        self.quantized_length += keys.shape[-2]

    def _materialize(self, new_k: torch.Tensor, new_v: torch.Tensor):
        """[dequantized chunks, residual, new tokens] for attention, in the shared scratch buffers."""
        B, H, _, D = new_k.shape
        n_res = self.keys.shape[-2]
        total = self.quantized_length + n_res + new_k.shape[-2]
        out = []
        for idx, (kind, res, new) in enumerate((("key", self.keys, new_k), ("value", self.values, new_v))):
            host, dev = self._scratch.get(kind, (B, H, total, D), self.dtype, self.device)
            arr = torch_to_numpy(host)  # a view: decoding writes straight into the scratch
            t = time.perf_counter()
            off = 0
            for chunk in self.chunks:
                p = chunk[idx]
                decode_packed(p, out=arr, token_offset=off, name=kind, n_threads=self.n_threads)
                off += p.shape[-2]
            self._owner.kernel_time_s += time.perf_counter() - t
            if dev is not host:
                dev[:, :, :off].copy_(host[:, :, :off])
            dev[:, :, off:off + n_res] = res
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
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if self.chunks:
            keys_out, values_out = self._materialize(key_states, value_states)
        else:
            keys_out = torch.cat([self.keys, key_states], dim=-2)
            values_out = torch.cat([self.values, value_states], dim=-2)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        n_res = self.keys.shape[-2]
        if n_res >= self.residual_length:
            n_flush = (n_res // self.residual_length) * self.residual_length
            self._encode(self.keys[:, :, :n_flush], self.values[:, :, :n_flush])
            self.keys = self.keys[:, :, n_flush:].contiguous()
            self.values = self.values[:, :, n_flush:].contiguous()
        return keys_out, values_out

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.chunks = []
        self.quantized_length = 0
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
        return sum(pk.nbytes + pv.nbytes for pk, pv in self.chunks)

    def residual_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()


class KvcxCache(Cache):
    """A packed INT4 KV cache for ``model.generate(..., past_key_values=KvcxCache(model.config))``.

    Parameters
    ----------
    config: the model's config (its decoder text config is used for the layer count).
    group_size, scheme, bits, sinks, rotate: the codec, as for ``kvcx compress`` (default: the kvcx scheme).
    residual_length: tokens kept in full precision before they are packed (a multiple of the
        group size when keys are grouped per channel).
    kv_config: a ready :class:`kvcx.kvconfig.KVConfig` instead of the options above.
    """

    def __init__(self, config, group_size: int = 64, scheme: str = DEFAULT_SCHEME, residual_length: int = 128,
                 bits: Optional[int] = None, sinks: Optional[int] = None, rotate: Optional[bool] = None,
                 kv_config: Optional[KVConfig] = None, n_threads: Optional[int] = None):
        kv = kv_config or KVConfig.from_scheme(scheme, group_size=group_size, bits=bits, sinks=sinks, rotate=rotate,
                                               n_threads=n_threads)
        if kv_config is not None and n_threads is not None:  # n_threads applies to a ready config too
            kv = KVConfig(key=kv.key.with_threads(n_threads), value=kv.value.with_threads(n_threads), scheme=kv.scheme)
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
        self.kv_config = kv
        self.residual_length = residual_length
        self.kernel_time_s = 0.0
        self._scratch = _Scratch()
        super().__init__(layers=[KvcxLayer(kv, residual_length, self._scratch, self)
                                 for _ in range(text.num_hidden_layers)])

    def memory_report(self) -> dict:
        """Bytes the cache holds: packed chunks + full-precision residual (scratch reported apart)."""
        packed = sum(layer.packed_bytes() for layer in self.layers)
        residual = sum(layer.residual_bytes() for layer in self.layers)
        values = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, D = layer.keys.shape
                values += 2 * B * H * layer.cumulative_length * D
        return {"packed_bytes": packed, "residual_bytes": residual, "total_bytes": packed + residual,
                "scratch_bytes": self._scratch.nbytes(), "tokens": self.get_seq_length(),
                "fp16_equivalent_bytes": 2 * values,
                "model_dtype_equivalent_bytes": values * (self.layers[0].keys.element_size()
                                                          if self.layers and self.layers[0].is_initialized else 2),
                "bits_per_value": 8.0 * (packed + residual) / values if values else 0.0}

    def nbytes(self) -> int:
        return self.memory_report()["total_bytes"]


def dynamic_cache_bytes(cache) -> int:
    """Bytes held by a transformers DynamicCache (keys + values of every layer)."""
    from kvcx.kv_cache import cache_layers

    return int(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache_layers(cache)))
