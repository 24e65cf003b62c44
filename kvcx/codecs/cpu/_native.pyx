# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""kvcx's CPU kernels built for the machine that built it (-march=native or KVCX_MARCH): a source build's opt-in; see kvcx.codecs.cpu."""

include "core.pxi"

VARIANT = "native"
