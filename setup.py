"""Build kvcx's CPU kernels (kvcx.codecs.cpu): one Cython module body compiled once per instruction set.

Variants (kvcx.codecs.cpu picks the best one the CPU runs at import; ``kvcx info`` names it):
- default on x86-64: ``_v3`` (``-march=x86-64-v3``: AVX2, FMA, F16C, the baseline a wheel runs on) and ``_v4``
  (``-march=x86-64-v4``: AVX-512), so a wheel built on any machine runs on any x86-64-v3 CPU and uses AVX-512
  where the CPU has it; elsewhere ``_generic`` (no target flags);
- ``KVCX_MARCH=native`` (or another -march value): one ``_native`` module built for this machine (a source
  build's opt-in: fastest here, may not run on another CPU); ``KVCX_MARCH=none``: ``_generic`` only.
OpenMP: ``-fopenmp`` is added to compile and link flags when a probe program builds and runs with it;
``KVCX_NO_OPENMP=1`` opts out. Without OpenMP the kernels run single-threaded.
The variants compile side by side, one a core (``build_ext --parallel N`` or ``-j N`` sets another count).
"""
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_PROBE = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    printf("%d\n", n);
    return n > 0 ? 0 : 1;
}
"""


def _compiler():
    return os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"


def _probe(flags, source="int main(void){return 0;}\n", run=False):
    cc = _compiler()
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as fh:
            fh.write(source)
        try:
            r = subprocess.run([cc, *flags, src, "-o", exe], capture_output=True, timeout=120)
            if r.returncode != 0:
                return False
            if run:
                return subprocess.run([exe], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def _flags():
    compile_args = ["-O3", "-std=c11", "-fno-math-errno", "-fno-trapping-math"] if sys.platform != "win32" else ["/O2"]
    link_args = []
    if os.environ.get("KVCX_NO_OPENMP", "0") not in ("", "0"):
        print("kvcx: KVCX_NO_OPENMP set; building without OpenMP", file=sys.stderr)
    elif sys.platform == "win32":
        compile_args.append("/openmp")
    elif _probe(["-fopenmp"], _PROBE, run=True):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    else:
        print("kvcx: compiler has no working OpenMP; building single-threaded", file=sys.stderr)
    return compile_args, link_args


def _variants():
    """(module, -march flags) of each kernel variant to build."""
    march = os.environ.get("KVCX_MARCH", "").strip()
    if march.lower() in ("none", "0", "generic") or sys.platform == "win32":
        return [("_generic", [])]
    if march:
        if _probe([f"-march={march}"]):
            return [("_native", [f"-march={march}"])]
        raise SystemExit(f"kvcx: the compiler rejects KVCX_MARCH={march!r} (-march={march}); unset it for the "
                         "portable variants")
    if platform.machine().lower() in ("x86_64", "amd64"):
        out = []
        for mod, level in (("_v3", "x86-64-v3"), ("_v4", "x86-64-v4")):
            if _probe([f"-march={level}"]):
                out.append((mod, [f"-march={level}", "-mtune=generic"]))
            else:
                print(f"kvcx: the compiler does not know -march={level}; {mod} not built", file=sys.stderr)
        if out:
            return out
    return [("_generic", [])]


compile_args, link_args = _flags()
KERNELS = "kvcx/codecs/cpu"
# every header, declaration and included body: a change to any of them rebuilds the variants
DEPENDS = sorted(os.path.join(KERNELS, f) for f in os.listdir(KERNELS) if f.endswith((".h", ".pxd", ".pxi")))
extensions = [
    Extension(
        f"kvcx.codecs.cpu.{mod}",
        [f"{KERNELS}/{mod}.pyx"],
        include_dirs=[np.get_include(), KERNELS],
        depends=DEPENDS,
        extra_compile_args=compile_args + flags,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for mod, flags in _variants()
]

class ParallelBuildExt(build_ext):
    """build_ext compiling the variants side by side (a core each) unless --parallel / -j says otherwise: the same
    objects, in half the time on two cores (an editable install, ``make build`` and the wheel all build here)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = max(1, min(len(self.extensions), os.cpu_count() or 1))


setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}, include_path=[KERNELS]),
      cmdclass={"build_ext": ParallelBuildExt})
