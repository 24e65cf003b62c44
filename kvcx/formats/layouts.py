"""The layouts in which an engine hands a KV chunk to a store, and where the keys and values are in each.

LMCache gives a serde one tensor per chunk. Its shape depends on how the engine keeps its KV cache:

- ``kv_2ltd``: ``[2, layers, tokens, kv_heads * head_dim]``, keys at index 0 and values at index 1
  (engines that keep K and V in separate tensors: vLLM's GPU backends, LMCache's own KV_2LTD);
- ``vllm_cpu``: ``[layers, tokens, kv_heads * 2 * head_dim]``, one fused plane (vLLM's CPU attention keeps K and V
  in one tensor per layer, ``[blocks, kv_heads, block_size, 2 * head_dim]``, and LMCache copies its token rows
  as they are). Inside every (engine block, head) the ``block_size * 2 * head_dim`` values are the block's keys
  then its values, each in the order vLLM's CPU attention kernel (its "ISA") reads them:

  ==========  ==========================================  ==========================================
  isa         keys (block_size tokens x head_dim)          values
  ==========  ==========================================  ==========================================
  vec, vec16  ``[head_dim, block_size]`` (dim-major)       ``[block_size, head_dim]`` (token-major)
  amx         ``[block_size/16, head_dim/2, 16, 2]``       ``[head_dim/16, block_size/2, 16, 2]``
  ==========  ==========================================  ==========================================

  (amx: 16-token tiles of dimension pairs for the keys, 16-dimension tiles of token pairs for the values, as
  AMX's BF16 tiles read them). vLLM picks the ISA from the model's dtype, its block size and head size and
  the CPU: ``amx`` for BF16 with a block size and head size that are multiples of 32 on a CPU with AMX tiles,
  otherwise ``vec``/``vec16`` (one order). These orders are checked against vLLM's own cache-write kernel
  in tests/integrations/test_vllm_layout.py.
- ``mla``: ``[layers, tokens, latent]``, one latent plane per token (MLA models), encoded with the key codec.

Nothing here guesses: a 4-D chunk is ``kv_2ltd``; a 3-D chunk is whichever single-plane layout the serde is
configured with (its shape cannot tell a fused plane from a latent one), and a fused plane needs the engine's
block size. The chunk wire format (:mod:`kvcx.formats.chunk`) records the layout, its ISA order and its block
size; a chunk is only ever decoded into the layout it was written from.

A layout turns a chunk into its planes, each ``(layers, tokens, heads * head_dim)`` C-contiguous
(:meth:`ChunkLayout.split`: views for ``kv_2ltd`` and ``mla``, a copy for a fused plane, made by the parallel
kernels of :mod:`kvcx.codecs.planes`), and planes back into a chunk (:meth:`ChunkLayout.join`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvcx.codecs.dtypes import is_int
from kvcx.codecs.planes import AMX_TILE, fused_join, fused_split
from kvcx.errors import CodecError

# wire codes (chunk header byte 9); 0 is what wire versions 1 and 2 hold there
CODE_KV_2LTD = 0
CODE_VLLM_CPU_VEC = 1
CODE_VLLM_CPU_AMX = 2
CODE_MLA = 3

ISAS = ("auto", "vec", "vec16", "amx")


@dataclass(frozen=True)
class Geometry:
    """What a chunk holds: ``planes`` tensors of ``(layers, tokens, heads * head_dim)``, and how it was found."""

    layout: "ChunkLayout"
    planes: int
    layers: int
    tokens: int
    heads: int
    head_dim: int

    @property
    def plane_shape(self) -> tuple:
        return (self.layers, self.tokens, self.heads * self.head_dim)


class ChunkLayout:
    """A chunk layout (see the module docstring). ``code`` and ``block_size`` are what the wire records."""

    name = "?"
    code = -1
    planes = 2
    block_size = 0

    def geometry(self, shape, head_dim: int, where: str) -> Geometry:
        raise NotImplementedError

    def chunk_shape(self, g: Geometry) -> tuple:
        """The chunk tensor's shape for a geometry (what a decode's destination must have)."""
        raise NotImplementedError

    def split(self, chunk, g: Geometry, n_threads: Optional[int] = None) -> list:
        """The chunk's planes, each C-contiguous ``g.plane_shape`` (views where the layout allows)."""
        raise NotImplementedError

    def join(self, planes, out, g: Geometry, n_threads: Optional[int] = None) -> None:
        """Write planes (as :meth:`split` returns them) into the chunk ``out``; a no-op where they are views."""

    def scratch(self, out, g: Geometry) -> list:
        """Where a decode writes the planes of a chunk bound for ``out``: views of it, or new arrays."""
        return self.split(out, g)

    def describe(self) -> str:
        return self.name

    def __eq__(self, other):
        return isinstance(other, ChunkLayout) and (self.code, self.block_size) == (other.code, other.block_size)

    def __hash__(self):
        return hash((self.code, self.block_size))

    def __repr__(self):
        return f"<chunk layout {self.describe()}>"


def _dims(shape, n: int, where: str, expect: str) -> tuple:
    shape = tuple(int(s) for s in shape)
    if len(shape) != n:
        raise CodecError(f"{where}: a KV chunk in this layout has shape {expect}, got {list(shape)}")
    if min(shape) < 1 or max(shape) > 2 ** 31 - 1:
        raise CodecError(f"{where}: chunk shape {list(shape)} has an empty or oversized dimension")
    return shape


class Kv2ltd(ChunkLayout):
    """``[2, layers, tokens, kv_heads * head_dim]``: keys and values are the two halves, read in place."""

    name, code, planes = "kv_2ltd", CODE_KV_2LTD, 2

    def geometry(self, shape, head_dim, where):
        s = _dims(shape, 4, where, "[2, layers, tokens, kv_heads * head_dim] (LMCache's KV_2LTD)")
        if s[0] != 2:
            raise CodecError(f"{where}: a KV chunk has shape [2, layers, tokens, kv_heads * head_dim] "
                             f"(LMCache's KV_2LTD), got {list(s)}")
        if s[3] % head_dim:
            raise CodecError(f"{where}: the last dim {s[3]} is not a multiple of head_dim {head_dim}; "
                             "set head_dim to the model's head size")
        return Geometry(self, 2, s[1], s[2], s[3] // head_dim, head_dim)

    def chunk_shape(self, g):
        return (2,) + g.plane_shape

    def split(self, chunk, g, n_threads=None):
        return [chunk[0], chunk[1]]


class Mla(ChunkLayout):
    """``[layers, tokens, latent]``: MLA's one latent plane per token, encoded with the key codec."""

    name, code, planes = "mla", CODE_MLA, 1

    def geometry(self, shape, head_dim, where):
        s = _dims(shape, 3, where, "[layers, tokens, latent] (an MLA latent plane)")
        return Geometry(self, 1, s[0], s[1], 1, s[2])

    def chunk_shape(self, g):
        return g.plane_shape

    def split(self, chunk, g, n_threads=None):
        return [chunk]


class VllmCpu(ChunkLayout):
    """vLLM's CPU attention cache as LMCache hands it: ``[layers, tokens, kv_heads * 2 * head_dim]``, each
    (engine block, head) holding its keys then its values in ``isa``'s order (see the module docstring).

    ``isa="auto"`` resolves as vLLM does on this host: ``amx`` for a BF16 chunk whose block size and head size
    are multiples of 32 where ``host_amx`` (the CPU has AMX tiles), else ``vec``.
    """

    name, planes = "vllm_cpu", 2

    def __init__(self, block_size: int, isa: str = "auto", host_amx: bool = False):
        if not is_int(block_size) or not 2 <= block_size <= 65535 or block_size % 2:
            raise CodecError(f"block_size must be the engine's block size, an even integer from 2 to 65535 "
                             f"(vLLM's --block-size; 128 by default on CPU), got {block_size!r}")
        if isa not in ISAS:
            raise CodecError(f"isa must be one of {', '.join(ISAS)} (vLLM's CPU attention kernel), got {isa!r}")
        self.block_size, self.isa, self.host_amx = int(block_size), isa, bool(host_amx)
        self.code = CODE_VLLM_CPU_AMX if isa == "amx" else CODE_VLLM_CPU_VEC

    def resolve(self, dtype_name: str, head_dim: int) -> "VllmCpu":
        """The layout with its ISA order fixed for a chunk of ``dtype_name`` ('BF16', 'F16', 'F32'): what the
        wire records."""
        if self.isa != "auto":
            return self
        amx = self.host_amx and dtype_name == "BF16" and self.block_size % 32 == 0 and head_dim % 32 == 0
        return VllmCpu(self.block_size, "amx" if amx else "vec")

    def describe(self):
        order = {"auto": "auto", "vec16": "vec"}.get(self.isa, self.isa)
        return f"vllm_cpu (isa {order}, block_size {self.block_size})"

    def __eq__(self, other):   # vec and vec16 are one order; auto is not a wire layout
        return isinstance(other, VllmCpu) and (self.code, self.block_size, self.isa == "auto") == \
            (other.code, other.block_size, other.isa == "auto")

    def __hash__(self):
        return hash((self.code, self.block_size, self.isa == "auto"))

    def geometry(self, shape, head_dim, where):
        s = _dims(shape, 3, where, "[layers, tokens, kv_heads * 2 * head_dim] (vLLM's CPU fused K/V plane)")
        L, T, W = s
        if W % (2 * head_dim):
            raise CodecError(f"{where}: the fused plane's last dim {W} is not a multiple of 2 * head_dim "
                             f"({2 * head_dim}); set head_dim to the model's head size")
        if T % self.block_size:
            raise CodecError(f"{where}: the chunk's {T} tokens are not a whole number of the engine's "
                             f"{self.block_size}-token blocks; set block_size to vLLM's --block-size (128 by "
                             "default on CPU), which must divide LMCache's --chunk-size")
        if self.isa == "amx" and (self.block_size % AMX_TILE or head_dim % AMX_TILE):
            raise CodecError(f"{where}: vLLM's amx order needs a block size and head_dim that are multiples of "
                             f"{AMX_TILE}, got {self.block_size} and {head_dim}; vLLM uses vec there: set isa "
                             "to vec or auto")
        return Geometry(self, 2, L, T, W // (2 * head_dim), head_dim)

    def chunk_shape(self, g):
        return (g.layers, g.tokens, g.heads * 2 * g.head_dim)

    def _order(self) -> str:
        if self.isa == "auto":
            raise CodecError("internal: an isa='auto' layout must be resolved for the chunk's dtype first")
        return "amx" if self.isa == "amx" else "vec"

    def split(self, chunk, g, n_threads=None):
        if not isinstance(chunk, np.ndarray):
            raise CodecError(f"a {self.describe()} chunk is a CPU layout: pass a NumPy array (a CPU tensor's .numpy())")
        return list(fused_split(chunk, self.block_size, g.head_dim, self._order(), n_threads=n_threads))

    def scratch(self, out, g):
        return [np.empty(g.plane_shape, out.dtype) for _ in range(2)]

    def join(self, planes, out, g, n_threads=None):
        fused_join(planes[0], planes[1], out, self.block_size, g.head_dim, self._order(), n_threads=n_threads)


KV_2LTD = Kv2ltd()
MLA = Mla()
PLANE_LAYOUTS = ("vllm_cpu", "mla")   # what a serde's ``layout`` option may name for 3-D chunks


def plane_layout(name: Optional[str], block_size: Optional[int] = None, isa: Optional[str] = None,
                 host_amx: bool = False) -> Optional[ChunkLayout]:
    """The single-plane layout a serde is configured with (None: none, 3-D chunks are refused)."""
    if name in (None, "auto", "kv_2ltd"):
        if block_size is not None or isa is not None:
            raise CodecError("block_size and isa describe vLLM's CPU fused plane: set layout to 'vllm_cpu' with them")
        return None
    if name == "mla":
        if block_size is not None or isa is not None:
            raise CodecError("an MLA latent plane has no engine block order: leave out block_size and isa")
        return MLA
    if name == "vllm_cpu":
        if block_size is None:
            raise CodecError("layout 'vllm_cpu' needs block_size, the engine's block size (vLLM's --block-size; "
                             "128 by default on CPU)")
        return VllmCpu(block_size, isa or "auto", host_amx)
    raise CodecError(f"layout must be one of auto, kv_2ltd, {', '.join(PLANE_LAYOUTS)}, got {name!r}")


def layout_for_shape(shape, plane: Optional[ChunkLayout], where: str) -> ChunkLayout:
    """The layout of a chunk of ``shape``: 4-D is KV_2LTD, 3-D is the configured single-plane layout."""
    n = len(tuple(shape))
    if n == 4:
        return KV_2LTD
    if n == 3:
        if plane is None:
            raise CodecError(f"{where}: a single-plane chunk {list(shape)} is either vLLM's CPU fused K/V plane "
                             "or an MLA latent plane, which its shape cannot tell: set the serde option layout to "
                             "'vllm_cpu' (with block_size, vLLM's --block-size: 128 by default on CPU) or 'mla'")
        return plane
    raise CodecError(f"{where}: a KV chunk has shape [2, layers, tokens, kv_heads * head_dim] (LMCache's KV_2LTD) "
                     f"or a single plane [layers, tokens, width], got {list(shape)}")


def layout_from_wire(code: int, block_size: int) -> Optional[ChunkLayout]:
    """The layout a chunk header records (None: a code this kvcx does not know)."""
    if code == CODE_KV_2LTD and block_size == 0:
        return KV_2LTD
    if code == CODE_MLA and block_size == 0:
        return MLA
    if code in (CODE_VLLM_CPU_VEC, CODE_VLLM_CPU_AMX) and block_size >= 2 and block_size % 2 == 0:
        return VllmCpu(block_size, "amx" if code == CODE_VLLM_CPU_AMX else "vec")
    return None
