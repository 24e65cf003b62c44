# The CPU kernels' module body, included by every instruction-set variant (_v3.pyx, _v4.pyx, ...): the same
# source compiled for each target; kvcx.codecs.cpu imports the one this CPU runs.
#
# kvcx compute kernels (nogil, OpenMP).
#
# Kernels only: every function here trusts its caller. Dtype, shape, contiguity
# and size checks, output allocation and error messages live in the codecs (``kvcx.codecs``).
#
# Tensors are seen as ``(N, S, D)``: N slabs (batch x heads), S tokens, D values
# per token (the contiguous last axis). Tokens ``[0, t0)`` of every slab are kept
# exact elsewhere; the kernels quantize tokens ``[t0, S)``.
#
# Code stream: the codes of the quantized part in C order, each slab starting on
# a byte boundary, bits packed LSB-first: with 4 bits, element 2i is the low
# nibble of byte i and element 2i+1 the high nibble. Codes are unsigned:
# symmetric ``q + 2**(bits-1)``, asymmetric ``q`` in ``[0, 2**bits - 1]``.
#
# Groups: ``axis=0`` ("token") groups run along each slab's flattened
# quantized part (``(S - t0) * D`` values, the last group of a slab may be
# partial); ``axis=1`` ("channel") groups run along tokens, one group per
# ``(slab, token block, channel)``. Optionally each token's D values are rotated by
# an orthonormal Walsh-Hadamard transform before quantization (the inverse is
# applied on decode).

from cython.parallel cimport prange, threadid
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t, int64_t
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free
from libc.math cimport rintf, sqrtf, fabsf, fabs, sqrt

from kvcx.codecs.cpu.openmp cimport omp_get_max_threads, KVCX_OPENMP_ENABLED

from kvcx.codecs.cpu.kernels cimport *

include "common.pxi"
include "codec.pxi"
include "widths.pxi"
include "metrics.pxi"
include "attn.pxi"
include "engine.pxi"
include "turboquant.pxi"
include "planes.pxi"
include "e8p.pxi"
