"""The GPU kernels compiled for a GPU and counted without one: the attention kernel's loop a token, the codec
kernels' instructions a value, by kind.

    python -m bench.sass_gpu [--markdown docs/results/gpu-sass.md] [--arch 90] [--dump DIR] [--limit N]

Each launch setting of :func:`kvcx.codecs.triton_kernels.attention.attend_packed_kernel` that bench_gpu.py's ``--tune`` times
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

The codec kernels (encode and decode of the default scheme's keys and values and of the reference's values) are
compiled as bench_gpu.py's bandwidth section launches them ([8, 8, 32768, 128] BF16: the launcher's constexprs,
Triton's own specialisation of the integer arguments) and counted whole: the kernel's body up to its exit (the
division's slow path, a subroutine after it, runs only for scales no encoder writes), times the threads of a
program, over the values a program holds. With it the table counts the global loads and stores by width: byte-wide
accesses of the packed codes were what the first H100 run's codec kernels issued.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
import time
from pathlib import Path

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
    """(SASS text, registers, stack bytes, kernel name, shared-memory bytes, tile tokens, warps a program) of the
    attention kernel at setting (its mode and warps as the shapes allow them)."""
    from kvcx.codecs import KVConfig, gpu_attn
    from kvcx.codecs.triton_kernels import attention as k

    s = setting   # a kvcx.codecs.gpu_attn.LaunchSettings
    cfg = KVConfig.from_scheme(SCHEME)
    consts = gpu_attn.attention_constexprs(cfg.key, cfg.value, 4, D, False, s, asm=s.asm, pdl=s.merge_pdl)
    bt, dot, stages, max_regs = consts["BT"], consts["DOT"], s.stages, s.max_registers
    warps = s.program_warps(dot)
    fn = k.attend_packed_kernel
    pointers = {"q_ptr": "*fp32", "mask_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                **{f"{n}{i}_ptr": "*u8" if n.endswith("c") else "*fp16" for n in ("kc", "vc", "ks", "kz", "vs", "vz")
                   for i in ("", "2")}}
    # the launch's divisibility hints: pointers and row strides divisible by 16, as torch's allocations are
    aligned = {"k_row_bytes", "v_row_bytes", "k_row_bytes2", "v_row_bytes2", "per_split"}
    sig = {a: "constexpr" if a in consts else "fp32" if a == "q_scale" else pointers.get(a, "i32")
           for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
             if a in pointers or a in aligned}
    opts = gpu_attn.attention_options(consts, s)
    name = f"attend_{bt}t_{warps}w_{dot or 'fp32'}{'_prefetch' if s.prefetch else ''}" + \
        (f"_s{stages}" if stages else "") + (f"_r{max_regs}" if max_regs else "") + \
        ("_early" if s.early_tile else "") + ("_pdl" if s.merge_pdl else "")
    return (*build(fn, sig, consts, attrs, opts, arch, dump, name), consts["BT"], warps)


def build(fn, sig, consts, attrs, opts, arch: int, dump: Path | None, name: str):
    """(SASS text, registers, stack bytes, kernel name, shared-memory bytes) of ``fn`` compiled for sm_``arch``;
    its SASS and TTGIR written to ``dump`` as ``name``.* when a folder is given."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32), options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(ck.asm["cubin"])
        sass = run_tool("cuobjdump", "-sass", str(path))
        res = run_tool("cuobjdump", "-res-usage", str(path))
    if dump is not None:
        (dump / f"{name}.sass").write_text(sass)
        (dump / f"{name}.ttgir").write_text(ck.asm["ttgir"])
    regs = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    return (sass, int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None, ck.name,
            ck.metadata.shared)


# what a Hopper multiprocessor holds (CUDA's occupancy rules for sm_90): registers, allocated 256 a warp; shared
# memory, 1 KiB of it reserved a program; warps; programs
SM_REGISTERS, REG_UNIT, SM_SHARED, SHARED_RESERVED, SM_WARPS, SM_PROGRAMS = 65536, 256, 233472, 1024, 64, 32


def resident(regs: int, shared: int, warps: int) -> int:
    """Programs of ``warps`` warps that one multiprocessor runs at once with ``regs`` registers a thread and
    ``shared`` bytes of shared memory a program: the fewest that any of its resources allows."""
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    return min(SM_REGISTERS // per_warp // warps, SM_SHARED // (shared + SHARED_RESERVED), SM_WARPS // warps,
               SM_PROGRAMS)


def run_tool(name: str, *args: str) -> str:
    """Triton's own copy of a CUDA binary tool (it ships cuobjdump and nvdisasm with ptxas)."""
    from triton.backends.nvidia import compiler

    tool = Path(compiler.__file__).resolve().parent / "bin" / name
    if not tool.exists():
        raise SystemExit(f"sass_gpu.py: {tool} is missing: this Triton does not ship {name}")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


def count(setting, arch, dump):
    sass, regs, stack, name, shared, bt, warps = compile_setting(setting, arch, dump)
    instrs = parse(sass, name)
    loop = main_loop(instrs)
    if loop is None:
        raise SystemExit(f"sass_gpu.py: no loop found in {name}'s SASS (setting {setting})")
    body = instrs[loop[0]:loop[1] + 1]
    kinds = collections.Counter(kind_of(op) for _, op, _ in body)
    return dict(total=len(instrs), loop=len(body), per_token=len(body) / bt, kinds=kinds, regs=regs, stack=stack,
                shared=shared, programs=resident(regs, shared, warps), warps=warps,
                local=sum(op.split(".")[0] in ("LDL", "STL") for _, op, _ in body), **waits(body))


# a load whose value is used within this many instructions of it waits out (most of) the memory's latency
NEAR = 100


def waits(body) -> dict:
    """What a loop waits on, from its SASS: ``near``, its global loads to registers (``LDG``) whose value is first
    used (in program order, around the loop) within :data:`NEAR` instructions; ``ahead``, the copies to shared
    memory (``LDGSTS``, Triton's pipelined loads) the loop lets stay in flight where it waits for them (``DEPBAR.LE
    SB0, n``: n commit groups, 0 = none: the next tile's loads are all awaited)."""
    near, ahead = 0, None
    for i, (_, op, args) in enumerate(body):
        if op.startswith("DEPBAR.LE"):
            m = re.search(r"0x([0-9a-f]+)", args)
            ahead = int(m.group(1), 16) if m and ahead is None else ahead
        if not op.startswith("LDG.") or op.startswith("LDGSTS"):
            continue
        dst = re.escape(args.split(",")[0].strip())
        for k in range(1, min(NEAR, len(body))):
            _, _, later = body[(i + k) % len(body)]
            if "," in later and re.search(rf"\b{dst}\b", later.split(",", 1)[1]):
                near += 1
                break
    return dict(near=near, ahead=ahead)


# the merge as bench_gpu.py's batch-1 steps launch it: the default scheme (values rotated), 1 sink and 32 residual
# tokens, no mask, 4 query rows a KV head, 132 splits (an H100's 8 programs a multiprocessor over 8 KV heads)
MERGE_SPLITS_A_ROW = 132


def count_merge(warps: int, chunk: int, pdl: bool, arch: int, dump: Path | None) -> dict:
    """The merge kernel at (warps a program, splits read at a time, dependent launch): its instructions and
    barriers (``BAR.SYNC``: the warps wait for one another, a reduction or a layout change across them) in all and
    after the grid-dependency wait (what a dependent launch leaves on the step's critical path), and in the loop
    over the splits' chunks (run once per chunk)."""
    from kvcx.codecs import gpu_attn, tensors

    fn = gpu_attn.attention_kernels().merge_kernel
    values = dict(q_scale=D ** -0.5, SPT=MERGE_SPLITS_A_ROW, n_sinks=1, n_res=32, add_stride=0, res_off=0, Hkv=8,
                  norm=tensors.norm_of(D))
    pointers = {**{a: "fp32" for a in ("m_ptr", "l_ptr", "acc_ptr", "add_ptr", "out_ptr")},
                **{a: "bf16" for a in ("q_ptr", "sk_ptr", "sv_ptr", "rk_ptr", "rv_ptr")}, "res_lens_ptr": "i32",
                "sl_ptr": "fp32"}
    const = dict(R=4, D=D, SB=1, RB=32, HAS_MASK=False, ROTATE=True, CH=chunk, PDL=pdl, RES_LENS=False, OUT_BF16=False)
    sig, attrs, consts = launch_signature(fn, values, const, pointers)
    opts = dict(num_warps=warps, enable_fp_fusion=gpu_attn.DEFAULT_LAUNCH.fp_fusion)
    sass, regs, stack, kname, _ = build(fn, sig, consts, attrs, opts, arch, dump, f"merge_{warps}w_{chunk}s")
    instrs = parse(sass, kname)
    wait = next((i for i, (_, op, _) in enumerate(instrs) if op.startswith("ACQBULK")), 0)
    loop = main_loop(instrs)
    bars = [i for i, (_, op, _) in enumerate(instrs) if op.startswith("BAR.SYNC")]
    return dict(total=len(instrs), after=len(instrs) - wait, bars=len(bars), bars_after=sum(i > wait for i in bars),
                loop=0 if loop is None else loop[1] - loop[0] + 1,
                loop_bars=0 if loop is None else sum(loop[0] <= i <= loop[1] for i in bars),
                chunks=-(-MERGE_SPLITS_A_ROW // chunk), regs=regs, stack=stack)


def merge_table(emit, settings, arch: int, dump: Path | None) -> None:
    emit(f"\n## The merge kernel, as a batch-1 step launches it ({MERGE_SPLITS_A_ROW} splits a query row, 1 sink and "
         "32 residual tokens, values rotated)\n")
    emit("A program a query row; its warps wait for one another at each barrier (a reduction or a layout change "
         "across warps, through shared memory). With the dependent launch, what comes before the wait (the query, "
         "the exact tokens and their softmax) runs while the attention kernel does; what follows it is on the step's "
         "critical path: the loop over the splits' chunks (its barriers once per chunk), the rotation back, the "
         "store.\n")
    emit("| merge warps | splits at a time | dependent launch | chunks a row | instructions | after the wait | "
         "in the loop | barriers | after the wait | in the loop | barriers after the wait, per row | registers | "
         "stack bytes |")
    emit("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for warps, chunk, pdl in dict.fromkeys((s.merge_warps, s.merge_splits, s.merge_pdl) for s in settings):
        r = count_merge(warps, chunk, pdl, arch, dump)
        path = r["bars_after"] - r["loop_bars"] + r["loop_bars"] * r["chunks"] if pdl else None
        emit(f"| {warps} | {chunk} | {'yes' if pdl else 'no'} | {r['chunks']} | {r['total']} | "
             f"{r['after'] if pdl else 'n/a'} | {r['loop']} | {r['bars']} | {r['bars_after'] if pdl else 'n/a'} | "
             f"{r['loop_bars']} | {path if path is not None else 'n/a'} | {r['regs']} | {r['stack']} |", flush=True)


# bench_gpu.py's bandwidth section: the tensor, and the codecs (label, scheme, which) it times, plus the reference's
CODEC_SHAPE = (8, 8, 32768, 128)
CODECS = (("kvcx keys (channel, zero points)", "kvcx", "key"), ("kvcx values (token, rotated)", "kvcx", "value"),
          ("reference values (token)", "reference", "value"))
WIDTHS = ("LDG", "STG")


def access_width(op: str) -> str:
    """A global load or store named with its width: LDG.E.128 -> LDG.128, STG.E.U8 -> STG.U8, STG.E -> STG.32."""
    last = op.split(".")[-1]
    return op.split(".")[0] + "." + ("32" if last.startswith("E") else last)


def launch_signature(fn, values: dict, consts: dict, pointers: dict):
    """(signature, attributes, constexprs) a launch of ``fn`` with these runtime argument values compiles:
    Triton's own specialisation of each integer (divisible by 16 marked, 1 made a constant), pointers as torch's
    allocations are (16-byte aligned); ``pointers`` names each pointer argument's element type."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sig, attrs, consts = {}, {}, dict(consts)
    for p in fn.params:   # constexprs left at their defaults (the hybrid models' softcap and sinks: off)
        if p.is_constexpr and p.has_default and p.name not in consts and p.name not in values:
            consts[p.name] = p.default
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        kind, hint = ("*" + pointers[a].lstrip("*"), "D") if a in pointers else \
            native_specialize_impl(BaseBackend, values[a], False, True, True)
        if kind == "constexpr":
            sig[a], consts[a] = "constexpr", values[a]
            continue
        sig[a] = kind
        if hint == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, consts


def count_codec(label: str, scheme: str, which: str, decode: bool, arch: int, dump: Path | None):
    """One codec kernel as bench_gpu.py launches it: a dict of its counts a value."""
    from kvcx.codecs import KVConfig, gpu, tensors

    codec = getattr(KVConfig.from_scheme(scheme), which)
    lay = codec.layout(CODEC_SHAPE, which)
    if decode:
        (_, fn), args, _, const = gpu._programs(codec, lay)
    else:            # as the launcher encodes (CODEC_LOOP: the blocks in a loop)
        fn, args, _, const = gpu.encode_launch(codec, lay)
    values = {**args, "norm": tensors.norm_of(lay.D), "pages": 1}
    pointers = {"codes_ptr": "u8", "scales_ptr": "fp16", "zeros_ptr": "fp16", "flag_ptr": "i32", "xb_ptr": "i16",
                "sinks_ptr": "i16", "sb_ptr": "i16", "ob_ptr": "i16", "where_ptr": "i32", "new_ptr": "bf16"}
    if decode:
        const.update(SAT=False, BF16=True)   # BF16 out: written as int16 bits (as the launcher does)
        values.update(out_S=lay.S, out_off=0)
        pointers["out_ptr"] = "i16"
    else:
        pointers["x_ptr"] = "bf16"
    sig, attrs, consts = launch_signature(fn, values, const, pointers)
    opts = dict(num_warps=gpu.CODEC_WARPS, enable_fp_fusion=False)
    name = f"{'decode' if decode else 'encode'}_{scheme}_{which}"
    sass, regs, stack, kname, _ = build(fn, sig, consts, attrs, opts, arch, dump, name)
    instrs = parse(sass, kname)
    exits = [i for i, (_, op, args) in enumerate(instrs) if op == "EXIT" and not args]
    body = instrs[:(exits[-1] if exits else len(instrs) - 1) + 1]
    per_program = const["R"] * const["G"] if codec.axis == "token" else const["G"] * min(const["CB"], lay.D)
    scale = 32 * gpu.CODEC_WARPS / per_program
    kinds = collections.Counter(kind_of(op) for _, op, _ in body)
    widths = collections.Counter(access_width(op) for _, op, _ in body if op.split(".")[0] in WIDTHS)
    return dict(label=label, kernel="decode" if decode else "encode", values=per_program, per_value=len(body) * scale,
                kinds={h: n * scale for h, n in kinds.items()}, regs=regs, stack=stack,
                accesses=", ".join(f"{n} {w}" for w, n in sorted(widths.items())))


def codec_table(emit, arch: int, dump: Path | None) -> None:
    from kvcx.codecs import gpu

    head = [label for label, _ in KINDS] + ["other"]
    emit(f"\n## Codec kernels, as bench_gpu.py's bandwidth section launches them ({list(CODEC_SHAPE)} BF16)\n")
    emit("Instructions a value: a thread's instructions from the kernel's start to its exit, times the "
         f"{gpu.CODEC_WARPS} warps' threads, over the values a program holds (a warp issues one 32nd of it a "
         "value); by kind the same way; a thread's global loads and stores by width (U8: a byte each; 64 / 128: "
         "8 / 16 bytes). The whole body counts, every branch: the per-token encode holds two copies of its work (a "
         "whole program's, unmasked, and a slab's last, masked), of which a program runs one; the sinks' copy and "
         "check run in a slab's first program only.\n")
    emit("| codec | kernel | values a program | instructions / value | " + " | ".join(head) +
         " | global accesses a thread | registers | stack bytes |")
    emit("|---|---|---:|---:|" + "---:|" * len(head) + "---|---:|---:|")
    for label, scheme, which in CODECS:
        for decode in (False, True):
            r = count_codec(label, scheme, which, decode, arch, dump)
            cells = " | ".join(f"{r['kinds'].get(h, 0):.1f}" for h in head)
            emit(f"| {r['label']} | {r['kernel']} | {r['values']} | {r['per_value']:.1f} | {cells} | "
                 f"{r['accesses']} | {r['regs']} | {r['stack']} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability as a number (90: H100, H200)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--dump", type=Path, default=None, help="write each compiled kernel's SASS and TTGIR here")
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

    from bench.gpu_common import SETTINGS, describe
    from bench.report import Report

    from kvcx.codecs import gpu_attn

    emit = Report()
    t0 = time.perf_counter()
    emit(f"Triton {triton.__version__}, target sm_{args.arch}; the {SCHEME} scheme's layout (keys per channel with "
         f"zero points, values rotated per token), head dim {D}, 4 query rows a KV head, no mask; the package's "
         f"default: {describe(gpu_attn.DEFAULT_LAUNCH)}.\n")
    emit("Instructions per token of context in the kernel's main loop (one iteration = one tile): a program's warp "
         "instructions (what the multiprocessors issue: a thread's count times the warps), a thread's, and a thread's "
         "by kind; registers a thread and the bytes of its stack frame (spills; ptxas) with the loop's accesses to it, "
         "shared memory a program, "
         "and the warps a multiprocessor runs at once by them (sm_90's occupancy rules: the more, the more of each "
         "other's latency they hide); and what a program's own loop waits on: its global loads whose value it uses "
         f"within {NEAR} instructions (the scales; each waits out most of the memory's latency), and the copies of "
         "the next tiles' codes to shared memory (Triton's pipelining) still in flight where the loop waits for "
         "its tile's (0: none, the next tile's loads issued at the loop's end are all awaited at its start).\n")
    head = [label for label, _ in KINDS] + ["other"]
    emit("| setting | tile tokens | warp instructions / token | loop instructions / token | " + " | ".join(head) +
         " | registers | stack bytes (spills) | spill accesses a loop | shared bytes | warps a multiprocessor | "
         f"kernel instructions | loads awaited within {NEAR} instructions a tile | load groups in flight at the wait |")
    emit("|---|---:|---:|---:|" + "---:|" * len(head) + "---:|---:|---:|---:|---:|---:|---:|---:|")
    for setting in SETTINGS[:args.limit]:
        r = count(setting, args.arch, args.dump)
        bt = r["loop"] / r["per_token"]
        cells = " | ".join(f"{r['kinds'].get(h, 0) / bt:.1f}" for h in head)
        warps = r["warps"]   # as compiled: the mode the shapes allow, its warps
        emit(f"| {describe(setting)} | {bt:.0f} | {r['per_token'] * warps:.1f} | {r['per_token']:.1f} | {cells} | "
             f"{r['regs']} | {r['stack']} | {r['local']} | {r['shared']} | {r['programs'] * warps} | "
             f"{r['total']} | {r['near']} | {'n/a' if r['ahead'] is None else r['ahead']} |", flush=True)
    merge_table(emit, SETTINGS[:args.limit], args.arch, args.dump)
    codec_table(emit, args.arch, args.dump)
    emit(f"\nTotal {time.perf_counter() - t0:.0f} s.")
    if args.markdown:
        emit.write(args.markdown, f"The GPU kernels compiled for sm_{args.arch} and counted offline: the attention "
                   "kernel's loop, the codec kernels (bench/sass_gpu.py).")


if __name__ == "__main__":
    main()
