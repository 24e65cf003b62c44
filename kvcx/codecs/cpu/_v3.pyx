# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""kvcx's CPU kernels built for x86-64-v3 (AVX2, FMA, F16C): the baseline a wheel runs on; see kvcx.codecs.cpu."""

include "core.pxi"

VARIANT = "x86-64-v3"
