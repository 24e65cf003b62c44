"""Where one fused decode step's time goes, kernel by kernel (torch.profiler's device timings).

    python -m bench.profile_gpu --markdown docs/results/gpu-profile.md      # on a CUDA machine, about a minute
    python -m bench.profile_gpu --smoke                                     # tiny shapes, the interpreter

The step of bench_gpu.py's section 1 (``DevicePackedKV.attend`` over the kvcx scheme's two-segment store, the
sink and a 32-token residual; Llama-3-8B's attention shapes, batch 1) at a short and two long contexts, with the
launch settings given (``--set``; else the package's defaults): each kernel it launches, its mean device time a step (the L2 flushed before
each step, as the bench does), and the step's whole time replayed from a CUDA graph beside the kernels' sum (the
difference: the gaps between kernels). Why: at 4k tokens the H100 run's step took 85 us where SDPA took 19, a fixed
cost the kernel's time a token does not explain; this says which launch holds it.
"""
from __future__ import annotations

import argparse
import ast
import os
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: every path runs (any device, the interpreter)")
    ap.add_argument("--markdown", default=None, help="also write the tables to this file")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="launch settings to use, as Python literals: the attention's by their "
                         "kvcx.codecs.gpu_attn.LaunchSettings field (e.g. split_tokens=128 prefetch=True dot='int8x3'), "
                         "the codec kernels' by their kvcx.codecs.gpu name (CODEC_WARPS=8)")
    ap.add_argument("--codecs", action="store_true",
                    help="also the encode and decode calls of bench_gpu.py's bandwidth section: their kernels, the "
                         "codec kernels' launch settings side by side, and the host's time a call by function")
    args = ap.parse_args(argv)
    from bench import gpu_common as common

    torch, dev = common.setup_device(args.smoke)
    from dataclasses import fields

    from kvcx.codecs import gpu, gpu_attn
    from kvcx.errors import KvcxError

    launch_fields = {f.name for f in fields(gpu_attn.LaunchSettings)}
    changes, settings = {}, {}   # the attention's LaunchSettings fields; the codec kernels' module settings
    for item in args.set:
        name, _, value = item.partition("=")
        codec = name.startswith(("CODEC_", "PROGRAM_")) and hasattr(gpu, name)
        if name not in launch_fields and not codec:
            ap.error(f"--set {item}: not a field of kvcx.codecs.gpu_attn.LaunchSettings "
                     f"({', '.join(sorted(launch_fields))}) or a codec setting of kvcx.codecs.gpu "
                     "(CODEC_WARPS, CODEC_LOOP, CODEC_CHANNELS, PROGRAM_VALUES)")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"--set {item}: the value is not a Python literal (a number, a string in quotes, None)")
        if not codec:
            changes[name] = parsed
            continue
        default = getattr(gpu, name)
        if isinstance(default, int) and not isinstance(default, bool) and not (type(parsed) is int and parsed >= 1):
            ap.error(f"--set {item}: {name} is a count; give a whole number from 1")
        if name.endswith("_WARPS") and parsed not in (1, 2, 4, 8, 16, 32):
            ap.error(f"--set {item}: a program's warps are a power of two, 1 to 32")
        settings[name] = parsed
    try:
        launch = gpu_attn.DEFAULT_LAUNCH.replace(**changes)   # checked by field, as when made
    except KvcxError as exc:
        ap.error(f"--set: {exc}")
    if dev.type != "cuda" and not args.smoke:
        ap.error("no CUDA device here: the full shapes would run for hours in Triton's interpreter; pass --smoke")
    saved = {name: getattr(gpu, name) for name in settings}
    try:   # the codec's settings for this run only (the module's own again after it, also when imported)
        for name, value in settings.items():
            setattr(gpu, name, value)
        profile(torch, dev, args, launch)
    except KvcxError as exc:   # a setting the kernels refuse, by its name
        ap.error(str(exc))
    finally:
        for name, value in saved.items():
            setattr(gpu, name, value)


def profile(torch, dev, args, launch=None) -> None:
    """The tables for the contexts of ``args`` (--smoke: one tiny one), written where ``args.markdown`` says, each
    step launched with ``launch`` (a LaunchSettings; None: the package's defaults)."""
    from bench import gpu_common as common
    from bench.report import Report

    from kvcx.codecs import KVConfig, gpu_attn

    launch = gpu_attn.launch_settings(launch)
    out = Report()
    out(f"Device: {torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'no GPU: the interpreter'}; torch "
        f"{torch.__version__}; triton {__import__('triton').__version__}; launch settings: "
        f"`{launch}`: {common.describe(launch)}; at least {launch.split_tokens} tokens a split")
    out("")
    cfg = KVConfig.from_scheme(common.SCHEME)
    if args.smoke:
        contexts, hq, hkv, d, steps, reps = (128,), 4, 2, 32, 2, 1
    else:
        contexts, hq, hkv, d, steps, reps = (4096, 32768, 131072), common.HQ, common.HKV, common.D, 20, 50
    t0 = time.perf_counter()
    for S in contexts:
        q, _, _, store, rk, rv = common.case(torch, dev, cfg, 1, S, hq, hkv, d, seed=S)
        step = lambda: store.attend(q.view(1, hq, d), rk, rv, None, d ** -0.5, launch=launch)  # noqa: E731
        for _ in range(3):
            step()
        rows = common.kernel_times(torch, dev, step, steps)
        graph = common.graph_timer(torch, dev, step, reps)
        total = sum(us for _, _, us in rows)
        out(f"### {S:,} tokens, batch 1: kernels {total:.1f} us a step; the step replayed from a CUDA graph "
            f"{common.us(graph)} us")
        out("")
        out("| kernel | launches a step | us a step | share |")
        out("|---|---:|---:|---:|")
        for name, n, us in rows:
            out(f"| `{name}` | {n:g} | {us:.1f} | {us / total:.0%} |")
        out("")
        store = rk = rv = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.codecs:
        codecs(torch, dev, out, args.smoke)
    out(f"Total {time.perf_counter() - t0:.0f} s.")
    if args.markdown:
        out.write(args.markdown, "One fused decode step, kernel by kernel (bench/profile_gpu.py).")


# the codec kernels' launch settings timed side by side: (values a per-token program quantizes, warps a program,
# CODEC_LOOP); the per-channel kernels hold a block of G tokens and (channels a program: CODEC_CHANNELS, None a whole
# row, warps, CODEC_LOOP). CODEC_LOOP: None a program a block or program's groups, else programs a multiprocessor
# that loop over them with the next one's values in flight: as many as their registers let run at once (sm_90, by
# bench/sass_gpu.py's count: 2 at 216 registers, 3 at 141 to 165, 5 at 96). Settings the H100 found slower (8
# warps, 16 channels a program of one warp: docs/RESULTS.md) are no longer timed
CODEC_SETTINGS = ((4096, 4, None), (2048, 4, None), (8192, 4, None), (2048, 2, None), (4096, 4, 3),
                  (2048, 4, 5))
CHANNEL_SETTINGS = ((None, 4, None), (64, 4, None), (32, 4, None), (32, 2, None), (None, 4, 2), (64, 4, 3),
                    (32, 4, 5))


def codecs(torch, dev, out, smoke: bool) -> None:
    """The encode and decode calls of bench_gpu.py's bandwidth section (the kvcx scheme's keys and values): each
    launch setting of :data:`CODEC_SETTINGS` (kernels' device time, the call's time), then at the package's
    settings every kernel a call launches and the host's time a call by function (cProfile)."""
    import cProfile
    import pstats

    from bench import gpu_common as common

    from kvcx.codecs import KVConfig, gpu

    shape, reps, steps = ((1, 2, 64, 32), 1, 1) if smoke else ((8, 8, 32768, 128), 20, 10)
    cfg = KVConfig.from_scheme(common.SCHEME)
    x = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def kernels_us(step):
        return common.kernels_us(torch, dev, step, steps)

    copy = kernels_us(lambda: y.copy_(x))
    out(f"### The codec calls, {list(shape)} BF16: launch settings (a device copy's kernel: {copy:.1f} us)")
    out("")
    out("| codec | values a program (per channel: tokens x channels) | warps | encode: programs a multiprocessor, "
        "looping | encode kernels (us) | encode call (us) | encode kernels / copy | decode kernels (us) | decode call "
        "(us) | decode kernels / copy |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    saved = gpu.PROGRAM_VALUES, gpu.CODEC_WARPS, gpu.CODEC_CHANNELS, gpu.CODEC_LOOP
    pairs = (("kvcx keys (channel, zero points)", cfg.key), ("kvcx values (token, rotated)", cfg.value))
    try:
        for label, codec in pairs:
            codec = codec.with_backend("triton")
            if codec.axis == "channel":   # a program: a block of G tokens x these channels
                settings = [(saved[0], warps, channels, loop) for channels, warps, loop in CHANNEL_SETTINGS]
            else:
                settings = [(values, warps, saved[2], loop) for values, warps, loop in CODEC_SETTINGS]
            for values, warps, channels, loop in settings[:2] + settings[-1:] if smoke else settings:
                gpu.PROGRAM_VALUES, gpu.CODEC_WARPS, gpu.CODEC_CHANNELS, gpu.CODEC_LOOP = values, warps, channels, loop
                p = codec.encode(x)
                enc, dec = kernels_us(lambda: codec.encode(x)), kernels_us(lambda: codec.decode(p, y))
                t_enc = common.timer(torch, dev, lambda: codec.encode(x), reps) * 1e6
                t_dec = common.timer(torch, dev, lambda: codec.decode(p, y), reps) * 1e6
                per = f"{codec.group_size} x {channels or shape[-1]}" if codec.axis == "channel" else str(values)
                looping = f"{loop}" if loop else "no loop"
                out(f"| {label} | {per} | {warps} | {looping} | {enc:.1f} | {t_enc:.1f} | {copy / enc:.2f} | "
                    f"{dec:.1f} | {t_dec:.1f} | {copy / dec:.2f} |")
    finally:
        gpu.PROGRAM_VALUES, gpu.CODEC_WARPS, gpu.CODEC_CHANNELS, gpu.CODEC_LOOP = saved
    out("")
    for label, codec in pairs:
        codec = codec.with_backend("triton")
        p = codec.encode(x)
        for kind, call in (("encode", lambda: codec.encode(x)), ("decode", lambda: codec.decode(p, y))):
            rows = common.kernel_times(torch, dev, call, steps)
            out(f"#### {label}, {kind}: the kernels of a call")
            out("")
            out("| kernel | launches a call | us a call |")
            out("|---|---:|---:|")
            for name, n, us in rows:
                out(f"| `{name}` | {n:g} | {us:.1f} |")
            out("")
            calls = 2 if smoke else 50
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            prof.disable()
            stats = pstats.Stats(prof).stats   # (file, line, function) -> (calls, primitive, tottime, cumtime, ..)
            top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
            out(f"The host's time a {kind} call, by function (cProfile over {calls} calls; own time, longest first):")
            out("")
            out("| function | calls a call | own us a call | with callees us a call |")
            out("|---|---:|---:|---:|")
            for (path, line, fn), (_, ncalls, tt, ct, _) in top:
                where = f"{os.path.basename(path)}:{line}" if line else path
                out(f"| `{fn}` ({where}) | {ncalls / calls:g} | {tt / calls * 1e6:.1f} | {ct / calls * 1e6:.1f} |")
            out("")


if __name__ == "__main__":
    main()
