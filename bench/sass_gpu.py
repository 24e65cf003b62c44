"""The attention kernel's compiled loop for a GPU, counted without one: instructions a token by kind.

    python bench/sass_gpu.py [--markdown docs/results/gpu-sass.md] [--arch 90] [--dump DIR] [--limit N]

Each launch setting of :func:`kvcx.codecs._triton.attend_packed_kernel` that bench_gpu.py's ``--tune`` times
(``SETTINGS``) is compiled for the target (sm_90: Triton's passes and ptxas, as at the first launch on an H100,
with the default scheme's constexprs and the launch's divisibility hints), disassembled with the ``cuobjdump``
that Triton ships, and its main loop (the one backward branch over the context's tiles) counted: SASS
instructions a loop iteration over the tile's tokens, by kind (tensor-core products, shared-memory traffic,
global loads, float and integer arithmetic, conversions, exponentials, shuffles), plus the registers a thread
holds and the bytes it spills. No GPU is needed and nothing runs.

Why: on the H100 run of bench_gpu.py (docs/results/gpu.md) the kernel is bound by the instructions it issues,
not by the bytes it reads, and the loop's count a token tracked the measured time across its settings (about
3.2 us at 128k tokens per instruction a token, +-20 %). Counting here says which change is worth a GPU session.
The count is per thread: a program of W warps issues W times as many warp instructions a tile.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

D = 128
SCHEME = "kvcx"
# (label, SASS opcode names) in the order of the table (see kind_of); any other opcode is "other"
KINDS = (("MMA", ("HMMA", "IMMA", "HGMMA")), ("shared", ("LDS", "STS", "LDSM", "LDGSTS")),
         ("global", ("LDG", "STG")), ("float", ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FCHK")),
         ("half", ("HADD2", "HMUL2", "HFMA2")), ("convert", ("F2F", "I2F", "F2I", "F2FP", "I2FP")),
         ("exp", ("MUFU",)), ("shuffle", ("SHFL",)), ("int", ("IMAD", "IADD", "LOP3", "SHF", "LEA", "ISETP", "SEL",
                                                          "PRMT", "IMNMX", "MOV", "IABS")))
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")


def kind_of(op: str) -> str:
    """The table's kind of a SASS opcode (its name before the first dot): the first kind that names it, or names
    a start of it of 4 letters or more (IADD takes IADD3; LDS does not take LDSM by itself)."""
    base = op.split(".")[0]
    return next((label for label, names in KINDS
                 if base in names or base.startswith(tuple(n for n in names if len(n) > 3))), "other")


def parse(sass: str, function: str):
    """[(address, opcode, operands)] of ``function``'s instructions, as cuobjdump prints them."""
    instrs, inside = [], False
    for line in sass.splitlines():
        if line.strip().startswith("Function :"):
            inside = line.split(":", 1)[1].strip() == function
            continue
        m = _INSTR.search(line) if inside else None
        if m:
            instrs.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return instrs


def main_loop(instrs):
    """(first, last) instruction indices of the largest loop: a branch back to an address before it."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    best = None
    for i, (addr, op, args) in enumerate(instrs):
        t = _TARGET.search(args) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr and int(t.group(1), 16) in index:
            first = index[int(t.group(1), 16)]
            if best is None or i - first > best[1] - best[0]:
                best = (first, i)
    return best


def compile_setting(setting, arch: int, dump: Path | None):
    """(SASS text, registers, stack bytes, kernel name, tile tokens) of the attention kernel at one launch
    setting."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcx.codecs import KVConfig, gpu
    from kvcx.codecs import _triton as k

    bt, warps, dot, prefetch, stages, _ = setting
    cfg = KVConfig.from_scheme(SCHEME)
    consts = gpu.attention_constexprs(cfg.key, cfg.value, 4, D, dot, bt, False, prefetch)
    fn = k.attend_packed_kernel
    pointers = {"q_ptr": "*fp32", "mask_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16",
                "vz_ptr": "*fp16"}
    # the launch's divisibility hints: pointers and row strides divisible by 16, as torch's allocations are
    aligned = {"k_row_bytes", "v_row_bytes", "per_split"}
    sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
             if a in pointers or a in aligned}
    opts = dict(num_warps=warps, enable_fp_fusion=gpu.ATTN_FP_FUSION)
    if stages:
        opts["num_stages"] = stages
    ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32), options=opts)
    cubin = ck.asm["cubin"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = run_tool("cuobjdump", "-sass", str(path))
        res = run_tool("cuobjdump", "-res-usage", str(path))
    if dump is not None:
        name = f"attend_{bt}t_{warps}w_{dot or 'fp32'}{'_prefetch' if prefetch else ''}" + \
            (f"_s{stages}" if stages else "")
        (dump / f"{name}.sass").write_text(sass)
        (dump / f"{name}.ttgir").write_text(ck.asm["ttgir"])
    regs = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    return sass, int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None, ck.name, \
        consts["BT"]


def run_tool(name: str, *args: str) -> str:
    """Triton's own copy of a CUDA binary tool (it ships cuobjdump and nvdisasm with ptxas)."""
    from triton.backends.nvidia import compiler

    tool = Path(compiler.__file__).resolve().parent / "bin" / name
    if not tool.exists():
        raise SystemExit(f"sass_gpu.py: {tool} is missing: this Triton does not ship {name}")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


def count(setting, arch, dump):
    sass, regs, stack, name, bt = compile_setting(setting, arch, dump)
    instrs = parse(sass, name)
    loop = main_loop(instrs)
    if loop is None:
        raise SystemExit(f"sass_gpu.py: no loop found in {name}'s SASS (setting {setting})")
    body = instrs[loop[0]:loop[1] + 1]
    kinds = collections.Counter(kind_of(op) for _, op, _ in body)
    return dict(total=len(instrs), loop=len(body), per_token=len(body) / bt, kinds=kinds, regs=regs, stack=stack)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability as a number (90: H100, H200)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--dump", type=Path, default=None, help="write each setting's SASS and TTGIR here")
    ap.add_argument("--limit", type=int, default=None, help="count only the first N settings")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit {args.limit}: count at least one setting")
    if args.dump is not None:
        try:
            args.dump.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            ap.error(f"--dump {args.dump}: cannot make the folder ({exc.strerror}); give a writable path")
    if args.arch < 80:
        ap.error(f"--arch {args.arch}: the kernel's tensor-core products need sm_80 or newer (80, 86, 89, 90, ...)")
    import triton

    from bench_gpu import SETTINGS, current, describe
    from report import Report

    from kvcx.codecs import gpu

    emit = Report()
    t0 = time.perf_counter()
    emit(f"Triton {triton.__version__}, target sm_{args.arch}; the {SCHEME} scheme's layout (keys per channel with "
         f"zero points, values rotated per token), head dim {D}, 4 query rows a KV head, no mask; the package's "
         f"default: {describe(current(gpu))}.\n")
    emit("Instructions per token of context in the kernel's main loop (one iteration = one tile): a program's warp "
         "instructions (what the multiprocessors issue: a thread's count times the warps), a thread's, and a thread's "
         "by kind; registers a thread and the bytes of its stack frame (spills; ptxas).\n")
    head = [label for label, _ in KINDS] + ["other"]
    emit("| setting | tile tokens | warp instructions / token | loop instructions / token | " + " | ".join(head) +
         " | registers | stack bytes (spills) | kernel instructions |")
    emit("|---|---:|---:|---:|" + "---:|" * len(head) + "---:|---:|---:|")
    for setting in SETTINGS[:args.limit]:
        r = count(setting, args.arch, args.dump)
        bt = r["loop"] / r["per_token"]
        cells = " | ".join(f"{r['kinds'].get(h, 0) / bt:.1f}" for h in head)
        emit(f"| {describe(setting)} | {bt:.0f} | {r['per_token'] * setting[1]:.0f} | {r['per_token']:.1f} | {cells} | "
             f"{r['regs']} | {r['stack']} | "
             f"{r['total']} |", flush=True)
    emit(f"\nTotal {time.perf_counter() - t0:.0f} s.")
    if args.markdown:
        emit.write(args.markdown, "The GPU attention kernel's compiled loop, counted offline (bench/sass_gpu.py).")


if __name__ == "__main__":
    main()
