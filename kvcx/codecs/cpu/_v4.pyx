# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""kvcx's CPU kernels built for x86-64-v4 (AVX-512 F, CD, BW, DQ, VL): chosen where the CPU has them; see kvcx.codecs.cpu."""

include "core.pxi"

VARIANT = "x86-64-v4"
