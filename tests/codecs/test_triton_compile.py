"""The Triton kernels compile for a real GPU, not only in the interpreter that runs them in CI.

Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py where there is no GPU) executes the kernels as
Python and accepts code that the GPU compiler refuses; kvcx's kernels once passed every interpreter test and did
not compile for CUDA at all. This test compiles each of them for sm_90 (Hopper: Triton's front end, its passes
and ptxas, which ship with triton) in a process without the interpreter. No GPU is needed.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("_compile_for_gpu.py")


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "kernels compiled for sm_90" in run.stdout
    # 12 codec kernels (two per-channel encodes with the blocks in a loop, two a decode step's), 11 attention (three
    # paged: one with a page a row), 3 merge (one with the residual's lengths on the device); the hybrids': 2
    # attention with a softcap, a merge with sinks and a softcap; E8P's scale, search and decode; the widths codec's
    # statistics, channels, encode and decode
    assert run.stdout.count("\nok ") + run.stdout.startswith("ok ") == 36
