"""What a KvcxCache's layers share: the materialising path's full-precision scratch, the step's attention mask as
the attention kernels read it (converted once per step: every layer gets the same mask), the release of the C
heap's free pages after a prompt is packed, the kernel timer, and the step's mode (:class:`Shared`,
:class:`StepMode`)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from kvcx.cache.fused import Mask, Workspace, step_mask
from kvcx.errors import KvcxError


class Scratch:
    """Growable full-precision buffers, one for keys and one for values, shared by every layer."""

    def __init__(self):
        self.host = {}
        self.device = {}

    @staticmethod
    def _buffer(pool: dict, kind: str, n: int, dtype: torch.dtype, device: torch.device, pin: bool = False):
        buf = pool.get(kind)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(n, int(n * 1.5)), dtype=dtype, device=device, pin_memory=pin)
            pool[kind] = buf
        return buf[:n]

    def get(self, kind: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, host: bool = True):
        """(host buffer, buffer on ``device``) of ``shape`` (the same tensor on the CPU); ``host=False``: (None,
        buffer on the device), for a store that decodes there."""
        n = int(np.prod(shape))
        if device.type == "cpu":
            buf = self._buffer(self.host, kind, n, dtype, device).view(shape)
            return buf, buf
        dev = self._buffer(self.device, kind, n, dtype, device).view(shape)
        if not host:
            return None, dev
        return self._buffer(self.host, kind, n, dtype, torch.device("cpu"), torch.cuda.is_available()).view(shape), dev

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for d in (self.host, self.device) for b in d.values())

    def release(self) -> None:
        if self.host or self.device:
            self.host.clear()
            self.device.clear()


class MaskConverter:
    """transformers' attention mask as the fused kernel reads it (:class:`kvcx.cache.fused.Mask`): a boolean
    mask viewed as bytes where it is contiguous, a float mask as float32; converted once per step and mask: every
    layer of a kind gets the same mask tensor, and a hybrid model's sliding and full layers each their own, so the
    last few are kept (by identity: the entry holds the tensor)."""

    KEEP = 4   # masks a step can alternate between (sliding, chunked, full), with room for the last step's

    def __init__(self):
        self._masks = {}   # id(mask tensor) -> (the tensor, its Mask, bytes held)
        self._adds = {}    # id(mask tensor) -> (the tensor, float32 [B, kv_len] on its device, bytes held)

    def _recent(self, memo: dict, attention_mask: torch.Tensor):
        hit = memo.get(id(attention_mask))
        return hit if hit is not None and hit[0] is attention_mask else None

    def _keep(self, memo: dict, attention_mask: torch.Tensor, entry: tuple) -> None:
        memo.pop(id(attention_mask), None)
        memo[id(attention_mask)] = entry
        while len(memo) > self.KEEP:
            memo.pop(next(iter(memo)))

    def convert(self, attention_mask: torch.Tensor, B: int, nq: int) -> Mask:
        hit = self._recent(self._masks, attention_mask)
        if hit is not None:
            return hit[1]
        m = attention_mask.detach()
        if m.dim() == 4 and m.shape[1] == 1:
            m = m[:, 0]
        elif m.dim() == 2:
            m = m[:, None]
        if m.dim() != 3 or m.shape[0] not in (1, B) or m.shape[1] not in (1, nq) or m.device.type != "cpu":
            raise KvcxError(f"KvcxCache: the attention mask {list(attention_mask.shape)} is not one mask per batch "
                            f"row of {B} (and query token of {nq}) on the CPU; pass the mask generate() builds")
        view = m.dtype in (torch.bool, torch.float32)   # numpy() then shares the tensor's memory
        arr = m.numpy() if m.dtype == torch.bool else m.to(torch.float32).numpy()
        mask = step_mask(arr, B, nq)
        held = mask.array
        copy = 0 if view and np.shares_memory(held, arr) else held.nbytes
        self._keep(self._masks, attention_mask,
                   (attention_mask, mask, attention_mask.numel() * attention_mask.element_size() + copy))
        return mask

    def nbytes(self) -> int:
        return sum(e[2] for memo in (self._masks, self._adds) for e in memo.values())

    def additive(self, attention_mask: torch.Tensor, B: int, kv_len: int) -> torch.Tensor:
        """A single-token step's mask as a float32 [B, kv_len] tensor on its device, added to the scores (0:
        attend, -inf: masked), as the Triton attention reads it."""
        hit = self._recent(self._adds, attention_mask)
        if hit is not None and hit[1].shape[1] == kv_len:
            return hit[1]
        m = attention_mask.detach()
        m = m.reshape(m.shape[0], -1) if m.dim() in (2, 3, 4) and m.numel() == m.shape[0] * kv_len else None
        if m is None or m.shape[0] not in (1, B) or m.shape[1] != kv_len:
            raise KvcxError(f"KvcxCache: the attention mask {list(attention_mask.shape)} is not one mask row of "
                            f"{kv_len} tokens per batch row of {B}; pass the mask generate() builds")
        add = (torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
               if m.dtype == torch.bool else m.to(torch.float32)).expand(B, kv_len).contiguous()
        self._keep(self._adds, attention_mask,
                   (attention_mask, add, attention_mask.numel() * attention_mask.element_size() + add.numel() * 4))
        return add


def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapRelease:
    """Hands the C heap's free pages back to the OS (glibc's ``malloc_trim``) after a layer packs a prompt
    chunk of at least ``min_tokens`` tokens on the CPU.

    Why: a long prompt's prefill makes large short-lived tensors (each layer's hidden states, queries and
    full-precision keys and values; 18 MB each for 8,000 tokens of a 576-wide model), and glibc serves them
    from its heap once its mmap threshold has risen. The packed store a layer keeps is small and born among
    them, so the freed space is split into holes the next layer's tensors do not fit: the heap grows layer
    after layer, and the process keeps the holes resident (with and without: the RSS table of
    docs/results/generate.md, ``bench/bench_generate.py``). A no-op where the C library has no ``malloc_trim``.
    """

    def __init__(self, enabled: bool = True, min_tokens: int = 1024):
        self._trim = _malloc_trim() if enabled else None
        self.min_tokens = min_tokens
        self.count = 0   # releases so far

    @property
    def active(self) -> bool:
        return self._trim is not None

    def after_pack(self, tokens: int) -> None:
        if self._trim is not None and tokens >= self.min_tokens:
            self._trim(0)
            self.count += 1


class KernelTimer:
    """Seconds spent in kvcx's kernels (encode, decode, fused attention) by one cache's layers."""

    def __init__(self):
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


FALLBACK_HINT = "pass fused=None to fall back to materialising"


@dataclass(frozen=True)
class StepMode:
    """What the cache decided for one step: layer steps may run fused (one token, or a few hundred over a
    packed history) unless ``reason`` says why not; ``required`` (``KvcxCache(fused=True)``) makes a step that
    cannot run fused an error."""

    reason: Optional[str] = None
    required: bool = False
    kvcx_attention: bool = True   # the model's attention is "kvcx" (a press needs it)


@dataclass(frozen=True)
class Shared:
    """What a cache's layers share: the materialising path's scratch, the fused kernel's workspace, the step's mask
    converted, the kernel timer, the C heap's release and how the device kernels launch
    (:class:`kvcx.codecs.gpu_attn.LaunchSettings`, or None: the defaults)."""

    scratch: Scratch
    workspace: Workspace
    masks: MaskConverter
    timer: KernelTimer
    heap: HeapRelease
    launch: object = None
