"""The kernel variants (kvcx.codecs.cpu): which one runs, and a variant this CPU cannot run refused by name."""
import importlib.util
import subprocess
import sys

import pytest

from kvcx.codecs import cpu
from kvcx.errors import CodecError, KernelImportError

# a CPU with AVX2 but no AVX-512, and one with both (NumPy's feature names)
V3_ONLY = {"AVX2": True, "FMA3": True, "F16C": True}
V4 = dict(V3_ONLY, **{f: True for f in cpu.VARIANTS["x86-64-v4"][1]})


def _x86_variants():
    have = cpu.built()
    if "x86-64-v3" not in have or "x86-64-v4" not in have:
        pytest.skip(f"this build holds {have}: the x86-64 variants are built on x86-64 only")


def test_choose_follows_the_cpu_features():
    _x86_variants()
    assert cpu.choose(features=V4) in ("native", "x86-64-v4")
    assert cpu.choose(features=V3_ONLY) in ("native", "x86-64-v3")
    assert cpu.missing("x86-64-v4", V3_ONLY) == ["AVX512F", "AVX512CD", "AVX512BW", "AVX512DQ", "AVX512VL"]


def test_forcing_a_variant_the_cpu_lacks_or_that_is_unknown_says_which():
    _x86_variants()
    with pytest.raises(CodecError, match=r"KVCX_KERNELS='x86-64-v4' needs CPU features this CPU lacks \(AVX512F"):
        cpu.choose("x86-64-v4", features=V3_ONLY)
    with pytest.raises(CodecError, match="is not a kernel variant; use one of"):
        cpu.choose("avx1024")


def test_guard_refuses_loading_a_variant_the_cpu_lacks_but_still_finds_it():
    _x86_variants()
    name = f"{cpu.__name__}._v4"
    spec = cpu.VariantGuard(features=V3_ONLY).find_spec(name)
    assert spec is not None and spec.origin.endswith(importlib.machinery.EXTENSION_SUFFIXES[0])
    with pytest.raises(KernelImportError, match=r"_v4: kvcx's x86-64-v4 kernels need CPU features this CPU lacks "
                                                r"\(AVX512F.*use kvcx\.codecs\.cpu\.core") as err:
        importlib.util.module_from_spec(spec)
    assert isinstance(err.value, ImportError) and isinstance(err.value, CodecError)
    # a CPU that has them, and every other module name: the usual finders' business
    assert cpu.VariantGuard(features=V4).find_spec(name) is None
    assert cpu.VariantGuard(features=V3_ONLY).find_spec(f"{cpu.__name__}._v3") is None
    assert cpu.VariantGuard(features=V3_ONLY).find_spec("json") is None
    # one guard on the import path, first
    guards = [f for f in sys.meta_path if type(f).__qualname__ == "VariantGuard"]
    assert len(guards) == 1 and sys.meta_path[0] is guards[0]


def test_importing_each_built_variant_by_name_on_this_cpu_imports_or_refuses_never_crashes():
    """In a child process: a variant this CPU runs imports; one it cannot is an ImportError naming what it lacks,
    where before its module init died of SIGILL (as the docs' API loader did, importing every submodule)."""
    for name in cpu.built():
        mod = f"{cpu.__name__}.{cpu.VARIANTS[name][0]}"
        run = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, timeout=120)
        lacking = cpu.missing(name)
        if lacking:
            assert run.returncode == 1, (name, run.returncode, run.stderr[-500:])
            assert f"KernelImportError: {mod}: kvcx's {name} kernels need CPU features this CPU lacks" in run.stderr
        else:
            assert run.returncode == 0, (name, run.returncode, run.stderr[-500:])
    # a tool importing every module of the package (as the docs' API loader does) skips what it cannot import, and
    # lives
    walk = ("import importlib, pkgutil, kvcx.codecs.cpu as c\n"
            "for m in pkgutil.iter_modules(c.__path__, c.__name__ + '.'):\n"
            "    try:\n        importlib.import_module(m.name); print('imported', m.name)\n"
            "    except ImportError:\n        print('refused', m.name)\n")
    run = subprocess.run([sys.executable, "-c", walk], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-500:])
    for name in cpu.built():
        mod = f"{cpu.__name__}.{cpu.VARIANTS[name][0]}"
        assert f"{'refused' if cpu.missing(name) else 'imported'} {mod}" in run.stdout.splitlines(), run.stdout
