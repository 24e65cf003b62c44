"""Other libraries' KV cache quantizers as ``kvcx validate`` settings, run through those libraries themselves
on the same cache and tokens as kvcx's codecs (prefix mode): what a user of them deploys, gated side by side.

- ``quanto-int4``, ``quanto-int2``: transformers' ``QuantoQuantizedLayer`` (the layer of
  ``QuantizedCache(backend="quanto")``) with its defaults: groups of 64 along the head dim, optimum-quanto's
  asymmetric int codes, a scale and a shift per group. Bytes counted as a GPU holds them: the codes plus an
  FP16 scale and shift per group (nbits + 0.5 bits per value; quanto keeps them in FP32 on a CPU FP32 cache).
- ``turboquant-4``, ``turboquant-3``: fused-turboquant's ``TurboQuantMSE`` (a random Hadamard rotation,
  Lloyd-Max levels for the Gaussian, one FP32 norm per vector) on its CPU path; bytes are its packed indices
  and norms as it stores them.

They need the ``peers`` extra (``pip install kvcx[peers]``: optimum-quanto, fused-turboquant). HQQ's layer
needs the ``hqq`` package, which pulls CUDA builds: not offered here. These settings have no kvcx file format,
so ``compress``, ``metrics`` and ``KvcxCache`` do not take them, and ``validate`` runs them in prefix mode.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvcx.codecs.metrics import ErrorStats, error_stats
from kvcx.errors import KvcxError

_LIBRARY = {"quanto": ("optimum.quanto", "optimum-quanto"), "turboquant": ("fused_turboquant", "fused-turboquant")}


@dataclass(frozen=True)
class PeerSetting:
    """One peer quantizer at one width: ``library`` "quanto" or "turboquant", ``bits`` its code width."""

    library: str
    bits: int

    @property
    def scheme(self) -> str:
        return f"{self.library}-{'int' if self.library == 'quanto' else ''}{self.bits}"

    def describe(self) -> str:
        return {"quanto": f"transformers QuantoQuantizedLayer int{self.bits}, groups of 64",
                "turboquant": f"fused-turboquant TurboQuantMSE {self.bits}-bit"}[self.library]

    def get_config(self) -> dict:
        return {"id": "peer", "library": self.library, "bits": self.bits}

    def check_installed(self) -> None:
        import importlib.util

        module, package = _LIBRARY[self.library]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise KvcxError(f"scheme={self.scheme!r} runs through {package}, which is not installed; "
                            "pip install 'kvcx[peers]'")

    def roundtrip(self, tensors):
        """(decoded tensors, bytes, ErrorStats) of the cache through the library."""
        fn = _quanto if self.library == "quanto" else _turboquant
        decoded, nbytes = fn(tensors, self.bits)
        total = ErrorStats()
        for name, a in tensors.items():
            total += error_stats(a, decoded[name], name=name)
        return decoded, int(nbytes), total


def roundtrip_of(setting):
    """The round trip ``validate`` runs for a setting: a peer's library, or kvcx's codecs and packed format."""
    if isinstance(setting, PeerSetting):
        return setting.roundtrip
    from kvcx.quality.bridge import roundtrip_tensors

    return lambda tensors: roundtrip_tensors(tensors, setting)


PEERS = {p.scheme: p for p in (PeerSetting("quanto", 4), PeerSetting("quanto", 2), PeerSetting("turboquant", 4),
                               PeerSetting("turboquant", 3))}


def _quanto(tensors, nbits):
    import torch
    from transformers.cache_utils import QuantoQuantizedLayer

    layer = QuantoQuantizedLayer(nbits=nbits, axis_key=0, axis_value=0, q_group_size=64, residual_length=128)
    dec = {}
    for k, v in tensors.items():
        x = torch.from_numpy(np.ascontiguousarray(v))
        dec[k] = layer._dequantize(layer._quantize(x, axis=0)).numpy().astype(v.dtype)
    return dec, sum(x.size for x in tensors.values()) * (nbits + 32 / 64) / 8


def _turboquant(tensors, bits):
    import torch

    dec, nbytes = {}, 0
    for k, v in tensors.items():
        q = _turboquant_for(v.shape[-1], bits)
        c = q.encode(torch.from_numpy(np.ascontiguousarray(v)).float())
        nbytes += c.indices.numel() * c.indices.element_size() + c.norms.numel() * c.norms.element_size()
        dec[k] = q.decode(c).float().numpy().astype(v.dtype)
    return dec, nbytes


@functools.lru_cache(maxsize=None)
def _turboquant_for(head_dim, bits):
    """One TurboQuantMSE per head dim and width (its Lloyd-Max codebook takes seconds to build)."""
    from fused_turboquant.core.quantizer import TurboQuantMSE

    return TurboQuantMSE(head_dim=head_dim, bits=bits)
