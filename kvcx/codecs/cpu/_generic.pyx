# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""kvcx's CPU kernels built for no target flags (a CPU that is not x86-64); see kvcx.codecs.cpu."""

include "core.pxi"

VARIANT = "generic"
