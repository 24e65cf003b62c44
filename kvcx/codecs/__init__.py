"""The codecs: the only door to kvcx's compiled kernels (:mod:`kvcx.codecs.cpu`, one variant per instruction set,
chosen for the CPU at import; the Triton kernels of :mod:`kvcx.codecs.triton_kernels` for CUDA tensors).

Everything that encodes or decodes a tensor goes through a :class:`Codec` found in the registry by its
id (:func:`get_codec`); new codecs register with :func:`register_codec`. The package also holds what
the kernels share with their callers: dtypes, conversions, threads and error metrics.

- :mod:`kvcx.codecs.base`: the interface, :class:`Packed`, :class:`Layout`, the registry;
- :mod:`kvcx.codecs.intcodec`: :class:`IntCodec` (2/3/4/8-bit groups per token or per channel);
- :mod:`kvcx.codecs.widths`: :class:`WidthCodec` (a bit width per key channel);
- :mod:`kvcx.codecs.lattice`: :class:`E8PCodec` (Hadamard rotation + QuIP#'s E8P lattice, 2 bits, no calibration);
- :mod:`kvcx.codecs.kvconfig`: :class:`KVConfig` (a key and a value codec, the named schemes, plans' layers);
- :mod:`kvcx.codecs.backends`, :mod:`kvcx.codecs.gpu`, :mod:`kvcx.codecs.gpu_lattice`, :mod:`kvcx.codecs.gpu_widths`:
  where torch tensors are worked on (the Triton kernels of :mod:`kvcx.codecs.triton_kernels.codec`, ``.lattice`` and
  ``.widths`` for CUDA tensors, the
  same bytes as the CPU kernels);
  :mod:`kvcx.codecs.tensors`: torch <-> NumPy without copies (torch imported when used);
- :mod:`kvcx.codecs.attention`: the CPU fused attention over packed codes (for :mod:`kvcx.cache.fused`);
  :mod:`kvcx.codecs.planes`: vLLM's fused K/V planes split and joined;
- :mod:`kvcx.codecs.convert`, :mod:`kvcx.codecs.metrics`, :mod:`kvcx.codecs.runtime`, :mod:`kvcx.codecs.dtypes`.
"""
from kvcx.codecs import gpu  # noqa: F401  - registers the Triton backends (torch and triton load when used)
from kvcx.codecs.base import Codec, Layout, Packed, decode, get_codec, register_codec, registered_codecs
from kvcx.codecs.intcodec import IntCodec
from kvcx.codecs.kvconfig import KVConfig
from kvcx.codecs.lattice import E8PCodec
from kvcx.codecs.rope import KeyRope
from kvcx.codecs import gpu_lattice  # noqa: F401,E402  - E8P's Triton backend
from kvcx.codecs.widths import WidthCodec
from kvcx.codecs import gpu_widths  # noqa: F401,E402  - the widths codec's Triton backend

__all__ = ["Codec", "Layout", "Packed", "IntCodec", "WidthCodec", "E8PCodec", "KVConfig", "KeyRope", "decode",
           "get_codec", "register_codec", "registered_codecs"]
