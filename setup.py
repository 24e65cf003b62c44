"""Build the kvcx.codecs._core Cython extension.

OpenMP: ``-fopenmp`` is added to compile and link flags when a probe program
builds and runs with it; ``KVCX_NO_OPENMP=1`` opts out. Without OpenMP the
kernels run single-threaded.
SIMD: ``-march=native`` by default (the extension is built where it runs);
set ``KVCX_MARCH`` to another value (e.g. ``x86-64-v3``) or to ``none``.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

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
    march = os.environ.get("KVCX_MARCH", "native")
    if sys.platform != "win32" and march.lower() not in ("", "none", "0"):
        if _probe([f"-march={march}"]):
            compile_args.append(f"-march={march}")
        else:
            print(f"kvcx: compiler rejects -march={march}; building without it", file=sys.stderr)
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


compile_args, link_args = _flags()
KERNELS = "kvcx/codecs"
extensions = [
    Extension(
        "kvcx.codecs._core",
        [f"{KERNELS}/_core.pyx"],
        include_dirs=[np.get_include(), KERNELS],
        # every header and declaration file: a change to any of them rebuilds the extension
        depends=sorted(os.path.join(KERNELS, f) for f in os.listdir(KERNELS) if f.endswith((".h", ".pxd"))),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
