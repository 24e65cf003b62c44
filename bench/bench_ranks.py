"""The gate data-parallel: ``kvcx validate`` under torchrun with N ranks against one process, on the same windows.

    python -m bench.bench_ranks [--windows 16] [--ranks 2] [--markdown docs/results/scaling-out.md]

Three runs of ``kvcx validate --json`` (prefix mode, the default scheme, windows of 1,024 tokens), each timed from
its start to its exit (the model's load included: what a user waits for): one process with one thread, one process
with ``--ranks`` threads (the same cores as the ranks), and ``torchrun --nproc-per-node RANKS`` with one thread a
rank (gloo). ratio = the one-process run's seconds / torchrun's (> 1: torchrun faster). The JSON of every run is
compared with the first's, every field but the times (``wall_time_s``, ``codec_time_s``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.report import Report

TIMING = ("wall_time_s", "codec_time_s")
TARGET = 1.6   # the bar: 2 ranks of one thread against one process, 16 windows


def run(launcher: list, threads: int, windows: int, dataset: str) -> tuple:
    """(seconds, the JSON) of one ``kvcx validate`` run."""
    cmd = [*launcher, "-m", "kvcx", "validate", "--json", "--max-windows", str(windows), "--threads", str(threads),
           *(["--dataset-file", dataset] if dataset else [])]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    took = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return took, json.loads(done.stdout)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dataset-file", default=os.environ.get("KVCX_DATASET_FILE", ""))
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    out = Report()
    py = [sys.executable]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port",
                str(_port())]
    rows = [("1 process, 1 thread", *run(py, 1, args.windows, args.dataset_file)),
            (f"1 process, {args.ranks} threads", *run(py, args.ranks, args.windows, args.dataset_file)),
            (f"torchrun, {args.ranks} ranks of 1 thread", *run(torchrun, 1, args.windows, args.dataset_file))]
    def figures(js: dict) -> dict:
        return {k: v for k, v in js.items() if k not in TIMING}

    first = rows[0][2]
    what = (f"# The gate data-parallel: kvcx validate under torchrun\n\n`kvcx validate` (prefix mode, the default "
            f"scheme), {first['windows']} windows of {first['window']} tokens ({first['tokens_scored']:,} tokens "
            f"scored) on {first['model']}, {first['device']}; each run timed from its start to its exit (the model's "
            f"load in it); threads: OMP_NUM_THREADS and --threads. ratio = that run's seconds / torchrun's (> 1: "
            f"torchrun faster). The JSON columns: every field but the times equal to the first run's.")
    print(what)
    out("| run | seconds | ratio | JSON = the first run's | baseline ppl | compressed ppl | delta |")
    out("|---|---:|---:|---|---:|---:|---:|")
    ranked = rows[-1][1]
    for label, took, js in rows:
        out(f"| {label} | {took:.1f} | {took / ranked:.2f}x | {'yes' if figures(js) == figures(first) else 'NO'} | "
            f"{js['baseline_perplexity']:.6f} | {js['compressed_perplexity']:.6f} | {js['delta']:+.6f} |")
    speedup = rows[0][1] / ranked
    out(f"\n{args.ranks} ranks of one thread against one process of one thread: {speedup:.2f}x (target >= "
        f"{TARGET}x: {'met' if speedup >= TARGET else 'missed'}); against one process of {args.ranks} threads: "
        f"{rows[1][1] / ranked:.2f}x.")
    if args.markdown:
        out.write(args.markdown, what)


if __name__ == "__main__":
    main()
