"""Compile every Triton kernel of kvcx for a real GPU (sm_90, Hopper) with no GPU present: Triton's front end,
its MLIR passes and ptxas run as they would at the first launch on an H100, for the launch settings the backend
uses (constexprs from kvcx.codecs.gpu's own helpers). Run without TRITON_INTERPRET (the interpreter accepts
code that the compiler refuses: a global that is not a constexpr, a constexpr assigned in a loop).

    python tests/codecs/_compile_for_gpu.py        # exit 1 and the compiler's message on the first failure
"""
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcx.codecs import IntCodec, KVConfig, gpu, gpu_attn, tensors
from kvcx.codecs.triton_kernels import codec as k
from kvcx.codecs.triton_kernels import attention as ka
from kvcx.codecs.triton_kernels import lattice as kl
from kvcx.codecs.triton_kernels import widths as kw
from kvcx.codecs import gpu_lattice, gpu_widths

TARGET = GPUTarget("cuda", 90, 32)
D = 128
# pointer arguments by name (what the launchers pass); every other argument is an int but ``norm``
POINTERS = {
    "x_ptr": "*bf16", "codes_ptr": "*u8", "kc_ptr": "*u8", "vc_ptr": "*u8", "kc2_ptr": "*u8", "vc2_ptr": "*u8",
    "out_ptr": "*i16", "flag_ptr": "*i32", "xb_ptr": "*i16", "sinks_ptr": "*i16", "sb_ptr": "*i16", "ob_ptr": "*i16",
    **{n: "*fp16" for n in ("scales_ptr", "zeros_ptr", "ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr", "ks2_ptr", "kz2_ptr",
                            "vs2_ptr", "vz2_ptr")},
    **{n: "*fp32" for n in ("q_ptr", "qs_ptr", "mask_ptr", "add_ptr", "m_ptr", "l_ptr", "acc_ptr")},
    **{n: "*bf16" for n in ("sk_ptr", "sv_ptr", "rk_ptr", "rv_ptr")},
    "pages_ptr": "*i32", "lens_ptr": "*i32", "res_lens_ptr": "*i32", "where_ptr": "*i64", "new_ptr": "*bf16",
    "sl_ptr": "*fp32", "y_ptr": "*fp32", "rec_ptr": "*u8", "abs_ptr": "*fp32", "norm2_ptr": "*fp32",
    "negpar_ptr": "*i32", "grid_ptr": "*i8",
    **{n: "*fp32" for n in ("mn_ptr", "mx_ptr", "me_ptr", "lo_ptr", "hi_ptr", "top_ptr")}, "spread_ptr": "*fp64",
    "w_ptr": "*u8", "off_ptr": "*i64", "slab_off_ptr": "*i64", "gbytes_ptr": "*i64",
}


JOBS = []   # (kernel name, constexprs, warps, FMA fusion, pointer types), compiled by _compile in worker processes


def compile_one(fn, consts: dict, num_warps: int = 4, fusion: bool = False, ptx_has: tuple = (), ftz: bool = True,
                **pointers) -> None:
    """Queue a compile of ``fn`` with these constexprs (and FMA fusion and libdevice's flush to zero as its launcher
    sets them); ``pointers`` overrides :data:`POINTERS` by argument name; ``ptx_has``: instructions its PTX must
    hold."""
    JOBS.append((fn.__name__, consts, num_warps, fusion, pointers, ptx_has, ftz))


def _compile(job) -> str:
    """"ok ..." or the compiler's own message, with the kernel and its settings."""
    name, consts, num_warps, fusion, pointers, ptx_has, ftz = job
    fn = getattr(k, name, None) or getattr(ka, name, None) or getattr(kl, name, None) or getattr(kw, name)
    types = {**POINTERS, **pointers}
    sig = {a: "constexpr" if a in consts else "fp32" if a in ("norm", "q_scale", "rms", "gain") else types.get(a, "i32")
           for a in fn.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn, sig, consts), target=TARGET,
                                  options=dict(num_warps=num_warps, enable_fp_fusion=fusion, enable_reflect_ftz=ftz))
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        return f"{name} {consts} does not compile for sm_90: {type(cause).__name__}: {cause}"
    missing = [op for op in ptx_has if op not in compiled.asm["ptx"]]
    if missing:
        return f"{name} {consts}: its PTX has no {', '.join(missing)}"
    return f"ok {name} {consts}"


def codec_kernels() -> None:
    """Encode and decode, each branch of ASYM and ROTATE in each kernel once (the default's keys and values, the
    reference, a rotated channel grouping), the per-channel encode's blocks in a loop, and the default's keys and
    values as a static cache's decode step encodes them (the token written, the page encoded in place)."""
    for scheme, axis, rotate in (("asymmetric", "channel", False), ("symmetric", "token", True),
                                 ("symmetric", "token", False), ("symmetric", "channel", True)):
        codec = IntCodec(scheme=scheme, axis=axis, rotate=rotate, sinks=1)
        (enc, dec), _, _, const = gpu._programs(codec, codec.layout((1, 8, 100, D), "x"))
        compile_one(enc, const)
        compile_one(dec, {**const, "SAT": False, "BF16": True})
        if axis == "channel":   # the blocks in a loop a program (gpu.CODEC_LOOP)
            compile_one(enc, {**const, "STEP": 2})
        if scheme != "symmetric" or rotate and axis == "token":   # a decode step's (gpu.encode_into)
            compile_one(enc, gpu.encode_launch(codec.replace(sinks=0), codec.layout((1, 8, 64, D), "x"),
                                               paged=True)[3])


def lattice_kernels() -> None:
    """E8P's encode (the scale, its FP64 square root and division correctly rounded in the PTX, as the CPU's; the
    search) and decode (to BF16), at the launcher's program sizes."""
    R = gpu_lattice.program_rows(D)
    compile_one(kl.e8p_scale_kernel, dict(D=D, R=R), ptx_has=("sqrt.rn.f64", "div.rn.f64"))
    compile_one(kl.e8p_search_kernel, dict(D=D, V=gpu_lattice.SEARCH_VECTORS))
    compile_one(kl.e8p_decode_kernel, dict(D=D, R=R, SAT=False, BF16=True))


def widths_kernels() -> None:
    """The widths codec's encode (group statistics, the mean's division correctly rounded in the PTX as the CPU's;
    the channels' ranges and FP64 spreads; the codes and planes, every division correctly rounded) and decode (to
    BF16), kvcx2v's keys' groups of 64 tokens, at the launcher's program sizes."""
    P, ftz = gpu_widths.row_programs(D), gpu_widths.EXACT["enable_reflect_ftz"]
    compile_one(kw.w_stats_kernel, dict(D=D, DP=D, GS=64, P=P), ptx_has=("div.rn.f32",), ftz=ftz)
    compile_one(kw.w_channels_kernel, dict(D=D, DP=D, GS=64, P=P), ptx_has=("mul.rn.f64", "add.rn.f64"), ftz=ftz)
    # floor and ceil as C's: no flush of subnormals to zero (cvt.rmi.f32.f32, not cvt.rmi.ftz.f32.f32)
    compile_one(kw.w_encode_kernel, dict(D=D, DP=D, GS=64), ptx_has=("div.rn.f32", "cvt.rmi.f32.f32 ",
                                                                     "cvt.rpi.f32.f32 "), ftz=ftz)
    compile_one(kw.w_decode_kernel, dict(D=D, DP=D, GS=64, SAT=False, BF16=True), ptx_has=("div.rn.f32",), ftz=ftz)


def attention_kernels() -> None:
    """The packed attention with the default launch settings (gpu_attn.DEFAULT_LAUNCH: the fast mode, FP16 products with the codes
    converted in PTX) for the default scheme, the reference (per-token keys, FP32 sums) and kivi (per-token values
    with zero points, one TF32 pass, prefetch; and in the fast mode), the other products (tl.dot in FP32, in three
    TF32 passes, and on the integer tensor cores for the default and the reference), the paged store's (also with
    the first tile early and the dependent launch's PTX), and the merge with and without a mask (and as a dependent
    launch)."""
    base = gpu_attn.DEFAULT_LAUNCH
    for scheme, dot, prefetch in (("kvcx", base.dot, base.prefetch), ("reference", "", False),
                                  ("kivi", "tf32", True), ("kvcx", "ieee", False), ("kvcx", "tf32x3", False),
                                  ("kvcx", "int8x3", False), ("reference", "int8x3", False), ("kivi", "fp16", False)):
        cfg = KVConfig.from_scheme(scheme)
        launch = base.replace(dot=dot, prefetch=prefetch)
        const = gpu_attn.attention_constexprs(cfg.key, cfg.value, 4, D, True, launch, asm=launch.asm)
        compile_one(ka.attend_packed_kernel, const,   # the fast mode's codes converted in PTX, as on a GPU
                    num_warps=gpu_attn.attention_options(const, launch)["num_warps"], fusion=launch.fp_fusion)
    cfg = KVConfig.from_scheme("kvcx")   # the paged store (kvcx.codecs.paged): tiles through the block table
    const = {**gpu_attn.attention_constexprs(cfg.key, cfg.value, 4, D, False, base, asm=base.asm, page=64), "PAGE": 64}
    warps = gpu_attn.attention_options(const, base)["num_warps"]
    compile_one(ka.attend_packed_kernel, const, num_warps=warps, fusion=base.fp_fusion)
    # a page a row as long as the sequence's capacity (kvcx.cache.static_cache): a multiple of the tiles, not a power
    # of two
    compile_one(ka.attend_packed_kernel, {**const, "PAGE": 33 * gpu_attn.TILE_TOKENS}, num_warps=warps,
                fusion=base.fp_fusion)
    # and with the first tile loaded before the query, the merge as a dependent launch (griddepcontrol in PTX)
    compile_one(ka.attend_packed_kernel, {**const, "EARLY": True, "PDL": True}, num_warps=warps, fusion=base.fp_fusion)
    # the residual's lengths read on the device with the dependent launch, writing BF16 (kvcx.cache.static_cache's
    # steps)
    for has_mask, rotate, pdl, res_lens in ((True, True, False, False), (False, False, True, False),
                                            (False, True, True, True)):
        compile_one(ka.merge_kernel, dict(R=4, D=D, SB=tensors.pow2(1), RB=tensors.pow2(32), HAS_MASK=has_mask,
                                         ROTATE=rotate, CH=base.merge_splits, PDL=pdl, RES_LENS=res_lens,
                                         OUT_BF16=res_lens),
                    fusion=base.fp_fusion, num_warps=base.merge_warps,
                    out_ptr="*i16" if res_lens else "*fp32")
    # the hybrid models' attention: logit softcapping (Gemma 2) in the fast mode and in FP32 sums, and the merge with
    # per-head sinks (GPT-OSS) and the softcap on the exact tokens
    for dot in (base.dot, ""):
        launch = base.replace(dot=dot, prefetch=False)
        const = gpu_attn.attention_constexprs(cfg.key, cfg.value, 4, D, True, launch, asm=launch.asm, softcap=50.0)
        compile_one(ka.attend_packed_kernel, const, num_warps=gpu_attn.attention_options(const, launch)["num_warps"],
                    fusion=launch.fp_fusion)
    compile_one(ka.merge_kernel, dict(R=4, D=D, SB=tensors.pow2(1), RB=tensors.pow2(32), HAS_MASK=True, ROTATE=True,
                                      CH=base.merge_splits, HAS_SINKS=True, SOFTCAP=50.0),
                fusion=base.fp_fusion, num_warps=base.merge_warps, out_ptr="*fp32")


if __name__ == "__main__":
    codec_kernels()
    lattice_kernels()
    widths_kernels()
    attention_kernels()
    # the compiles are independent and each keeps one core busy: one process a core (forked where the platform
    # forks: nothing to import again)
    fork = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    with ProcessPoolExecutor(min(4, os.cpu_count() or 1), mp_context=fork) as pool:
        for line in pool.map(_compile, JOBS):
            if not line.startswith("ok "):
                sys.exit(line)
            print(line)
    print(f"{len(JOBS)} kernels compiled for sm_90 (triton {triton.__version__})")
