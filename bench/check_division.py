"""The Triton encoder's division by a group's scale, checked against a correctly rounded division on hard cases.

    python -m bench.check_division [--markdown docs/results/division.md]

The Triton codec kernels compute ``(x - zero) / scale`` as ``q = a * r`` with ``r`` the correctly rounded
reciprocal of the scale (once a group), then two FMA corrections (``kvcx.codecs.triton_kernels.codec._div``), where the CPU
kernels divide. The codes are the same only if ``rint(clamp(q))`` is the CPU's for every value. This script
takes every positive finite FP16 scale (as the kernels see it, in FP32), and the 41 FP32 values nearest each
rounding boundary k + 1/2 of the codes times that scale, plus random quotients, for the symmetric (-8..7) and the
asymmetric (0..15) code ranges. It computes the steps in FP32 with an exact FMA (the one Triton's interpreter
runs), and counts the codes that differ from those of a correctly rounded division (NumPy's FP32 division), for
no correction, one and two. It also counts the quotients that differ. No GPU is needed.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

NEIGHBOURS = 20          # FP32 values each side of (k + 1/2) * scale
RANDOM = 200_000         # random quotients a boundary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    try:
        from triton._C.libtriton import interpreter
    except ImportError:
        raise SystemExit("check_division.py needs triton (pip install 'kvcx[gpu]'): its exact FP32 FMA") from None
    from bench.report import Report

    def fma(a, b, c):
        return interpreter.fma_fp32(*np.broadcast_arrays(a, b, c))

    f32 = np.float32
    scales = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(f32)   # every positive finite FP16
    rng = np.random.default_rng(0)
    wrong = {"product by the reciprocal": 0, "one correction": 0, "two corrections (the kernels')": 0}
    quotients = dict.fromkeys(wrong, 0)
    cases = 0
    t0 = time.perf_counter()
    for lo, hi in ((-8.0, 7.0), (0.0, 15.0)):
        for b in np.arange(lo - 1, hi + 2) + 0.5:
            s = np.repeat(scales, 2 * NEIGHBOURS + 1)
            c = (f32(b) * s).astype(f32)
            steps = np.tile(np.arange(-NEIGHBOURS, NEIGHBOURS + 1), scales.size)
            t = (c.view(np.int32) + np.where(c < 0, -steps, steps)).astype(np.int32).view(f32)
            s2 = rng.choice(scales, RANDOM)
            t2 = (rng.uniform(lo - 2, hi + 2, RANDOM).astype(f32) * s2).astype(f32)
            s, t = np.concatenate([s, s2]), np.concatenate([t, t2])
            keep = np.isfinite(t)
            s, t = s[keep], t[keep]
            exact = (t / s).astype(f32)
            want = np.rint(np.clip(exact, lo, hi))
            y = (f32(1) / s).astype(f32)
            q = (t * y).astype(f32)
            for name in wrong:
                wrong[name] += int(np.sum(np.rint(np.clip(q, lo, hi)) != want))
                quotients[name] += int(np.sum(q != exact))
                q = fma(fma(-s, q, t), y, q)
            cases += t.size
    emit = Report()
    emit(f"{cases:,} quotients x / scale: every positive finite FP16 scale, the {2 * NEIGHBOURS + 1} FP32 values "
         f"nearest each rounding boundary k + 1/2 of the codes (and those just outside the code range) times the "
         f"scale, and {RANDOM:,} random quotients a boundary; symmetric codes -8..7 and asymmetric 0..15. Baseline: "
         "NumPy's correctly rounded FP32 division, then rint and the clamp, as the CPU kernels do.\n")
    emit("| the kernel's quotient | codes that differ | quotients that differ from the correctly rounded one |")
    emit("|---|---:|---:|")
    for name in wrong:
        emit(f"| {name} | {wrong[name]:,} | {quotients[name]:,} |")
    emit(f"\nTotal {time.perf_counter() - t0:.0f} s.")
    if args.markdown:
        emit.write(args.markdown, "The Triton encoder's division by a reciprocal, checked offline "
                   "(bench/check_division.py).")


if __name__ == "__main__":
    main()
