"""kvcx's CPU kernels: C headers by what they compute, one Cython module body, compiled once per instruction set.

- ``base.h`` (the constants shared with Python, the tensor layout, dtype conversions, CRC-32C), ``quant.h``
  (quantize, pack, unpack), ``hadamard.h`` (the rotation), gathered by ``kernels.h``; ``attn_simd.h``,
  ``attn_blocks.h``, ``attn_widths.h``, ``attn_e8p.h`` and ``attn.h`` (the fused attention over packed codes);
  ``widths.h`` (per-channel widths), ``e8p.h`` (the E8P lattice codec), ``engine.h`` (llama.cpp's and vLLM's
  formats), ``turboquant.h`` (vLLM's TurboQuant), ``fused.h`` (vLLM's fused K/V planes);
- ``core.pxi``: the module body (``common``, ``codec``, ``widths``, ``e8p``, ``metrics``, ``attn``, ``engine``,
  ``turboquant``, ``planes`` ``.pxi``), which every variant module includes: the SIMD paths in the headers are
  chosen by the compiler's target macros, so each variant is the same source built for one target (as NumPy and
  ggml build their per-architecture kernels and pick one at run time).

The variants a build holds (``setup.py``): ``x86-64-v3`` (AVX2, FMA, F16C: the baseline a wheel runs on) and
``x86-64-v4`` (AVX-512 F/CD/BW/DQ/VL) on x86-64; ``generic`` elsewhere; ``native`` (``-march=native``, or
another ``KVCX_MARCH``) only when a source build asks for it. At import the best variant this CPU can run is
chosen (a built ``native`` first: it was built here); ``$KVCX_KERNELS`` forces one by name. :data:`core` is the
chosen module: the only place the rest of :mod:`kvcx.codecs` reaches the kernels through.

A variant this CPU cannot run is refused by name too: importing it (``import kvcx.codecs.cpu._v4`` on a CPU without
AVX-512, as a tool that walks the package's modules does) raises :class:`~kvcx.errors.KernelImportError`, an
``ImportError``, where running its module init, compiled for the other instruction set, would kill the process with
SIGILL (:class:`VariantGuard`, first on ``sys.meta_path`` once this package is imported, as it is before any of its
modules).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Dict, Optional, Tuple

from kvcx.errors import CodecError, KernelImportError

ENV = "KVCX_KERNELS"
# variant -> (module, CPU features it needs, as NumPy's runtime dispatch names them), in order of preference
VARIANTS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "native": ("_native", ()),
    "x86-64-v4": ("_v4", ("AVX2", "FMA3", "F16C", "AVX512F", "AVX512CD", "AVX512BW", "AVX512DQ", "AVX512VL")),
    "x86-64-v3": ("_v3", ("AVX2", "FMA3", "F16C")),
    "generic": ("_generic", ()),
}


def cpu_features() -> Dict[str, bool]:
    """The CPU's features as NumPy's runtime dispatch sees them (the operating system's support included)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:   # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return dict(__cpu_features__)


def built() -> list:
    """The variants this installation holds, in order of preference."""
    return [name for name, (mod, _) in VARIANTS.items() if importlib.util.find_spec(f"{__name__}.{mod}")]


def missing(name: str, features: Optional[Dict[str, bool]] = None) -> list:
    """The CPU features variant ``name`` needs that this CPU lacks."""
    features = cpu_features() if features is None else features
    return [f for f in VARIANTS[name][1] if not features.get(f)]


def choose(forced: Optional[str] = None, features: Optional[Dict[str, bool]] = None) -> str:
    """The variant to run: ``forced`` (a name, checked), else the first built one this CPU can run."""
    have = built()
    if not have:
        raise CodecError("kvcx's kernels are not built (no kvcx.codecs.cpu variant module): build them with "
                         "`make build` or `pip install .`")
    if forced:
        if forced not in VARIANTS:
            raise CodecError(f"{ENV}={forced!r} is not a kernel variant; use one of {', '.join(have)} (or unset it)")
        if forced not in have:
            raise CodecError(f"{ENV}={forced!r}: this installation holds the variants {', '.join(have)}; use one "
                             "of them (or unset it)")
        lacking = missing(forced, features)
        if lacking:
            raise CodecError(f"{ENV}={forced!r} needs CPU features this CPU lacks ({', '.join(lacking)}); use "
                             f"{', '.join(v for v in have if not missing(v, features)) or 'a source build'} (or "
                             "unset it)")
        return forced
    for name in have:
        if not missing(name, features):
            return name
    raise CodecError(f"this CPU lacks what kvcx's built kernels need ({', '.join(missing(have[-1], features))} for "
                     f"{have[-1]}); build them here from source: KVCX_MARCH=native pip install --no-binary kvcx kvcx")


class _Refused(importlib.abc.Loader):
    """The loader of a variant this CPU cannot run: it raises before the module's own code runs."""

    def __init__(self, name: str, lacking: list):
        self.name, self.lacking = name, lacking

    def create_module(self, spec):
        have = [v for v in built() if not missing(v)]
        raise KernelImportError(f"{spec.name}: kvcx's {self.name} kernels need CPU features this CPU lacks "
                                f"({', '.join(self.lacking)}), and running its code here would kill the process; "
                                f"use {__name__}.core (the variant this CPU runs: {', '.join(have) or 'none built'})")

    def exec_module(self, module):   # never reached: create_module raises
        raise AssertionError(module.__name__)


class VariantGuard(importlib.abc.MetaPathFinder):
    """Finds the variant modules this CPU cannot run (``features``: the CPU's, :func:`cpu_features` by default) and
    hands the import system a loader that refuses them; every other name goes on to the usual finders. Specs are
    still found (:func:`built` and ``importlib.util.find_spec`` see what is installed); only loading is refused."""

    def __init__(self, features: Optional[Dict[str, bool]] = None):
        self.features = features
        self.modules = {f"{__name__}.{mod}": name for name, (mod, _) in VARIANTS.items()}

    def find_spec(self, fullname, path=None, target=None):
        name = self.modules.get(fullname)
        if name is None:
            return None
        lacking = missing(name, self.features)
        if not lacking:
            return None
        found = importlib.machinery.PathFinder.find_spec(fullname, __path__ if path is None else path)
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Refused(name, lacking), origin=found.origin)


# one guard however often this module runs (a reload makes a new class: matched by name)
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__qualname__ != "VariantGuard" or type(f).__module__ != __name__]
sys.meta_path.insert(0, VariantGuard())

variant = choose(os.environ.get(ENV) or None)
core = importlib.import_module(f"{__name__}.{VARIANTS[variant][0]}")

__all__ = ["core", "variant", "VARIANTS", "ENV", "VariantGuard", "built", "choose", "cpu_features", "missing"]
