"""kvcx's bench scripts, a package: run each as ``python -m bench.NAME`` from the repository root (the Makefile's
``bench`` targets do); they share :mod:`bench.report`, and the GPU ones :mod:`bench.bench_gpu`."""
