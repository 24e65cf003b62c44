"""The CPU fused attention over packed codes (``kvcx/codecs/cpu/attn.h``), as the codecs' door hands it out:
the kernel object, its workspace size and its limits. Its one user is :mod:`kvcx.cache.fused`, which checks every
size and binds a layer's packed stores to it; nothing above the codecs reaches the compiled kernels otherwise."""
from __future__ import annotations

from kvcx.codecs.cpu import core as _core

AttnKernel = _core.AttnKernel               # one step of one layer: see its docstring and kvcx.cache.fused
ATTN_MAX_GROUP = _core.ATTN_MAX_GROUP       # query heads per KV head, at most
ATTN_MAX_D = _core.ATTN_MAX_D               # head dim, at most
ATTN_MAX_ROWS = _core.ATTN_MAX_ROWS         # rows per KV head (query heads x query tokens), at most
ATTN_TILE_ROWS = _core.ATTN_TILE_ROWS       # rows per KV head from which tiles are unpacked to floats once
AXIS_CHANNEL, AXIS_TOKEN = _core.AXIS_CHANNEL, _core.AXIS_TOKEN


def work_floats(rows: int, head_dim: int, widths: bool = False, vtile: bool = False) -> int:
    """Floats of workspace one task of the kernel needs (``vtile``: values read through a float tile: several
    groups a token, or E8P records)."""
    return _core.attn_work_floats(rows, head_dim, widths, vtile)
