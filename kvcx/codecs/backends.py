"""Where a codec's work runs: its CPU kernels, or a backend registered for its id (Triton on a GPU).

A NumPy array always goes to the CPU kernels. A torch tensor goes to the backend its codec names
(``backend="triton"`` forces the Triton kernels, which Triton's interpreter also runs on CPU tensors), else to
the one its device calls for (:data:`BY_DEVICE`: a CUDA tensor to ``"triton"``); a torch tensor with no
backend registered for it is worked on the host, through the CPU kernels, and comes back as it went in.
Backends register with :func:`register_backend`; the codecs find them through :func:`backend_for` (no type
tests, no if-chains).
"""
from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

from kvcx.errors import CodecError

TRITON = "triton"          # the device backend: the Triton kernels
BACKENDS = ("cpu", TRITON)
# the backend a tensor's device calls for when its codec names none
BY_DEVICE = {"cuda": "triton"}
_REGISTRY: Dict[Tuple[str, str], object] = {}


def register_backend(codec_id: str, name: str):
    """Class decorator: an instance of the class runs codec ``codec_id``'s encode and decode on ``name``."""
    if name not in BACKENDS:
        raise CodecError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")

    def deco(cls):
        _REGISTRY[(codec_id, name)] = cls()
        return cls

    return deco


def check_backend(backend) -> Optional[str]:
    """``backend`` if it names a backend (or is None: chosen by device), else CodecError."""
    if backend is not None and backend not in BACKENDS:
        raise CodecError(f"backend {backend!r} is not supported; use one of {', '.join(BACKENDS)}, or None to "
                         "choose by the tensor's device")
    return backend


def is_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch: a program that has none holds none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def backend_for(codec, x, name: str = "tensor"):
    """The backend object that works on ``x`` (a tensor, or a Packed's codes) for ``codec``, or None for the
    CPU kernels (NumPy arrays always; torch tensors on the CPU unless the codec names another backend)."""
    if not is_tensor(x):
        return None
    choice = getattr(codec, "backend", None) or BY_DEVICE.get(x.device.type, "cpu")
    found = _REGISTRY.get((codec.codec_id, choice))
    if found is None and choice != "cpu":
        raise CodecError(f"tensor {name!r}: codec {codec.codec_id!r} has no {choice!r} backend (it runs on the "
                         f"CPU); move the tensor to the CPU, or use a codec that has one "
                         f"({', '.join(sorted(c for c, b in _REGISTRY if b == choice)) or 'none'})")
    return found


def backend_name(codec, device_type: str) -> str:
    """The backend a torch tensor on ``device_type`` ("cuda", "cpu") is worked on for ``codec``, without running
    it: the codec's own (``backend=``), else its device's (:data:`BY_DEVICE`) where one is registered for the
    codec and takes it (the Triton backend: 4-bit codes, triton installed), else "cpu"."""
    if getattr(codec, "backend", None):
        return codec.backend
    name = BY_DEVICE.get(device_type, "cpu")
    found = _REGISTRY.get((codec.codec_id, name))
    return name if found is not None and found.takes(codec) and found.available() else "cpu"


def backend_takes(codec, name: str) -> bool:
    """Whether backend ``name`` is registered for ``codec`` and runs its settings (installed or not)."""
    found = _REGISTRY.get((codec.codec_id, name))
    return found is not None and found.takes(codec)


def registered_backends() -> Tuple[Tuple[str, str], ...]:
    """The (codec id, backend) pairs registered."""
    return tuple(sorted(_REGISTRY))
