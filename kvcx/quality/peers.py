"""Other libraries' KV cache quantizers as ``kvcx validate`` settings, run through those libraries themselves
on the same cache and tokens as kvcx's codecs (prefix mode): what a user of them deploys, gated side by side.

- ``quanto-int4``, ``quanto-int2``: transformers' ``QuantoQuantizedLayer`` (the layer of
  ``QuantizedCache(backend="quanto")``) with its defaults: groups of 64 along the head dim, optimum-quanto's
  asymmetric int codes, a scale and a shift per group. Bytes counted as a GPU holds them: the codes plus an
  FP16 scale and shift per group (nbits + 0.5 bits per value; quanto keeps them in FP32 on a CPU FP32 cache).
- ``hqq-int4``, ``hqq-int2``: transformers' ``HQQQuantizedLayer`` (``QuantizedCache(backend="hqq")``) with its
  defaults: axis 0, groups of 64, HQQ's half-quadratic optimisation of each group's scale and zero point
  (hqq's own ``Quantizer``). Axis 0 views the layer's [batch, heads, tokens, head dim] tensor as
  [64, numel / 64] and groups each column: 64 values numel / 64 apart, which is one channel over 64 of the
  tokens when heads x tokens is a multiple of 64 (per-channel groups for the values too) and mixes channels
  otherwise, exactly as transformers quantizes the cache. ``hqq-int4-axis1``, ``hqq-int2-axis1``: axis 1 (HQQ's
  own recommendation), [numel / 64, 64]: 64 consecutive values, a token's head dim. Counted as quanto:
  nbits + 0.5 bits per value (FP16 scale and zero per group of 64).
- ``turboquant-4``, ``turboquant-3``: fused-turboquant's ``TurboQuantMSE`` (a random Hadamard rotation,
  Lloyd-Max levels for the Gaussian, one FP32 norm per vector) on its CPU path; bytes are its packed indices
  and norms as it stores them.
- ``nexusquant-k4v4``, ``nexusquant-k3v2``, ``nexusquant-k2v2``: NexusQuant's calibration-free quant-only path
  (``NexusQuantQuantOnly``: keys' RoPE removed, a Hadamard rotation, E8 lattice vector quantization with one
  scale per vector at 2^bits levels, RoPE put back), through its own package on a transformers cache built from
  the same tensors, RoPE from the model's config. It writes dequantized FP16 values back, so its bytes are
  counted as a packed form would hold them: per 8 values an index over the lattice points its clamp can emit
  (log2((L+1)^8 + (L+2)^8) bits, L = 2^bits: integer points and half-integer points some clamped to +-L/2),
  and an FP16 scale per vector. Its own nominal count (bits + 16 / head_dim, e.g. K3V2 2.75 at head_dim 64) is
  in the setting's description.

They need the ``peers`` extra (``pip install kvcx[peers]``: optimum-quanto, hqq, fused-turboquant, nexusquant-kv). These
settings have no kvcx file format, so ``compress``, ``metrics`` and ``KvcxCache`` do not take them, and
``validate`` runs them in prefix mode.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from kvcx.codecs.metrics import ErrorStats, error_stats
from kvcx.errors import KvcxError

# library -> (module to find, package to install, prefix of the width in the scheme's name)
_LIBRARY = {"quanto": ("optimum.quanto", "optimum-quanto", "int"), "hqq": ("hqq.core.quantize", "hqq", "int"),
            "turboquant": ("fused_turboquant", "fused-turboquant", ""), "nexusquant": ("nexusquant", "nexusquant-kv", "k")}


@dataclass(frozen=True)
class PeerSetting:
    """One peer quantizer at one width: ``library`` "quanto", "hqq", "turboquant" or "nexusquant", ``bits`` its code
    width (NexusQuant: the keys', ``value_bits`` the values')."""

    library: str
    bits: int
    axis: int = 0          # the transformers layer's axis_key and axis_value (HQQ: 0 or 1)
    value_bits: int = 0    # NexusQuant's value width (0: the same as bits)

    @property
    def scheme(self) -> str:
        if self.library == "nexusquant":
            return f"nexusquant-k{self.bits}v{self.value_bits or self.bits}"
        return f"{self.library}-{_LIBRARY[self.library][2]}{self.bits}" + (f"-axis{self.axis}" if self.axis else "")

    def describe(self) -> str:
        vb = self.value_bits or self.bits
        return {"quanto": f"transformers QuantoQuantizedLayer int{self.bits}, groups of 64",
                "hqq": f"transformers HQQQuantizedLayer int{self.bits}, axis {self.axis}, groups of 64",
                "turboquant": f"fused-turboquant TurboQuantMSE {self.bits}-bit",
                "nexusquant": f"NexusQuant quant-only K{self.bits}V{vb} (Hadamard + E8 lattice; its own count "
                              f"{(self.bits + vb) / 2:g} + 16/head_dim bits/value, here a fixed-length index)"
                }[self.library]

    def get_config(self) -> dict:
        return {"id": "peer", "library": self.library, "bits": self.bits, **({"axis": self.axis} if self.axis else {}),
                **({"value_bits": self.value_bits} if self.value_bits else {})}

    def check_installed(self) -> None:
        import importlib.util

        module, package, _ = _LIBRARY[self.library]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise KvcxError(f"scheme={self.scheme!r} runs through {package}, which is not installed; "
                            "pip install 'kvcx[peers]'")

    def roundtrip(self, tensors, model_config=None):
        """(decoded tensors, bytes, ErrorStats) of the cache through the library; ``model_config``: the model's
        (NexusQuant takes the keys' RoPE from it)."""
        if self.library == "nexusquant":
            decoded, nbytes = _nexusquant(tensors, self.bits, self.value_bits or self.bits, model_config)
        else:
            decoded, nbytes = _ROUNDTRIPS[self.library](tensors, self.bits, self.axis)
        total = ErrorStats()
        for name, a in tensors.items():
            total += error_stats(a, decoded[name], name=name)
        return decoded, int(nbytes), total


def roundtrip_of(setting, model_config=None):
    """The round trip ``validate`` runs for a setting: a peer's library (given the model's config), a press and its
    codec, or kvcx's codecs and packed format."""
    if isinstance(setting, PeerSetting):
        return functools.partial(setting.roundtrip, model_config=model_config)
    from kvcx.presses import PressedSetting

    if isinstance(setting, PressedSetting):     # token eviction, then its codec (if any)
        from kvcx.quality.eviction import PressRoundtrip

        return PressRoundtrip(setting, roundtrip_of(setting.codec) if setting.codec is not None else None)
    from kvcx.quality.bridge import roundtrip_tensors

    return lambda tensors: roundtrip_tensors(tensors, setting)


PEERS = {p.scheme: p for p in (PeerSetting("quanto", 4), PeerSetting("quanto", 2), PeerSetting("hqq", 4),
                               PeerSetting("hqq", 2), PeerSetting("hqq", 4, axis=1), PeerSetting("hqq", 2, axis=1),
                               PeerSetting("turboquant", 4), PeerSetting("turboquant", 3),
                               PeerSetting("nexusquant", 4, value_bits=4), PeerSetting("nexusquant", 3, value_bits=2),
                               PeerSetting("nexusquant", 2, value_bits=2))}


def _transformers_layer(layer_name, tensors, nbits, axis):
    """Each tensor through a transformers quantized cache layer with its defaults (groups of 64, the given axis
    for keys and values): the layer's own quantize and dequantize, as its ``update`` runs them on a prefill."""
    import torch
    import transformers.cache_utils

    layer = getattr(transformers.cache_utils, layer_name)(nbits=nbits, axis_key=axis, axis_value=axis,
                                                          q_group_size=64, residual_length=128)
    dec = {}
    for k, v in tensors.items():
        if v.size % 64:
            raise KvcxError(f"tensor {k!r} of shape {tuple(v.shape)} does not split into {layer_name}'s groups of 64 "
                            "values; validate it with a kvcx scheme (their group size divides the head dim)")
        x = torch.from_numpy(np.ascontiguousarray(v))
        layer.lazy_initialization(x, x)      # the layer's dtype and device, as its first update sets them
        dec[k] = layer._dequantize(layer._quantize(x, axis=axis)).numpy().astype(v.dtype)
    return dec, sum(x.size for x in tensors.values()) * (nbits + 32 / 64) / 8


def _turboquant(tensors, bits, _axis):
    import torch

    dec, nbytes = {}, 0
    for k, v in tensors.items():
        q = _turboquant_for(v.shape[-1], bits)
        c = q.encode(torch.from_numpy(np.ascontiguousarray(v)).float())
        nbytes += c.indices.numel() * c.indices.element_size() + c.norms.numel() * c.norms.element_size()
        dec[k] = q.decode(c).float().numpy().astype(v.dtype)
    return dec, nbytes


_ROUNDTRIPS = {"quanto": functools.partial(_transformers_layer, "QuantoQuantizedLayer"),
               "hqq": functools.partial(_transformers_layer, "HQQQuantizedLayer"), "turboquant": _turboquant}


@functools.lru_cache(maxsize=None)
def _turboquant_for(head_dim, bits):
    """One TurboQuantMSE per head dim and width (its Lloyd-Max codebook takes seconds to build)."""
    from fused_turboquant.core.quantizer import TurboQuantMSE

    return TurboQuantMSE(head_dim=head_dim, bits=bits)


def e8_index_bits(bits: int) -> float:
    """Bits per value of a fixed-length index over the 8-value lattice points NexusQuant's clamp to +-L/2 can
    emit (L = 2^bits levels): integer points in [-L/2, L/2]^8, and half-integer points whose coordinates may be
    clamped to +-L/2: log2((L+1)^8 + (L+2)^8) / 8 (2.62 at 2 bits, 3.39 at 3, 4.26 at 4)."""
    L = 2 ** bits
    return math.log2((L + 1) ** 8 + (L + 2) ** 8) / 8


def _nexusquant(tensors, key_bits, value_bits, model_config):
    """The cache's layers through NexusQuantQuantOnly (its compress() on a DynamicCache of these tensors)."""
    import torch
    from nexusquant.core.rope_utils import resolve_rope_config
    from nexusquant.pipeline import NexusQuantQuantOnly
    from transformers import DynamicCache

    from kvcx.codecs.kvconfig import is_key_tensor, layer_of

    if model_config is None:
        raise KvcxError("NexusQuant removes the keys' RoPE before quantizing: it needs the model's config "
                        "(validate and passkey pass it)")
    pairs = {}
    for name, a in tensors.items():
        pairs.setdefault(layer_of(name), {})["key" if is_key_tensor(name) else "value"] = name
    layers = sorted(i for i in pairs if i is not None)
    if layers != list(range(len(pairs))) or any(len(p) != 2 for p in pairs.values()):
        raise KvcxError(f"NexusQuant compresses a cache of layers 0..n-1, each a key and a value; got tensors "
                        f"{sorted(tensors)[:6]}...: validate this model with a kvcx scheme")
    cache = DynamicCache()
    for i in layers:
        cache.update(torch.from_numpy(np.ascontiguousarray(tensors[pairs[i]["key"]])),
                     torch.from_numpy(np.ascontiguousarray(tensors[pairs[i]["value"]])), i)
    rope = resolve_rope_config(model_config)
    nq = NexusQuantQuantOnly(key_bits=key_bits, value_bits=value_bits, rope_base=rope["rope_theta"],
                             rope_scaling=rope.get("rope_scaling"))
    nq.set_model_config(model_config)
    nq.compress(cache)
    dec, nbits = {}, 0.0
    for i in layers:
        for kind, b in (("key", key_bits), ("value", value_bits)):
            name = pairs[i][kind]
            a = tensors[name]
            dec[name] = getattr(cache.layers[i], "keys" if kind == "key" else "values").numpy().astype(a.dtype)
            nbits += a.size * (e8_index_bits(b) + 16 / a.shape[-1])
    return dec, nbits / 8
