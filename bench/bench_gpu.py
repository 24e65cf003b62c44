"""kvcx on a CUDA GPU: fused decode attention over packed codes, encode/decode bandwidth, generate(), memory.

    python -m bench.bench_gpu --markdown docs/results/gpu.md          # on a CUDA machine, < 10 minutes
    python -m bench.bench_gpu --smoke                                 # tiny shapes, any device (the interpreter)
    python -m bench.bench_gpu --skip attention bandwidth generate --variants   # the attention kernel's settings
    python -m bench.bench_gpu --skip attention bandwidth --prompts 4096 32768 131072 --longest-batch-1 --fit 131072

Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head dim 128), random data, BF16, the default
scheme (keys per channel with zero points, values rotated per token; one exact sink token):

1. Decode attention at 4k, 16k, 32k, 64k and 128k tokens, batch 1 and 8: one layer's step through
   ``DevicePackedKV.attend`` (what a KvcxCache decode step runs: the Triton kernel over the packed segments,
   the sink and a 32-token residual in the same softmax) vs SDPA over the BF16 keys and values (GQA), and
   FlashAttention's ``flash_attn_with_kvcache`` where flash-attn is installed. Median of CUDA-event timings
   with the L2 cache flushed before each run; eager (each call launched from Python) and replayed from a CUDA
   graph (as serving engines run decode: the kernels alone). ratio = baseline time / kvcx time (> 1: kvcx
   faster). Bytes: what each reads.
2. Encode and decode bandwidth of the Triton codecs on [8, 8, 32k, 128] BF16 keys and values vs a
   device-to-device copy of the same tensor (bytes of the BF16 tensor / time, both).
3. Greedy decoding (one forward per token, as ``generate()`` steps) with a random-weight model of Llama-3-8B's
   shape (BF16): KvcxCache (fused, Triton) vs DynamicCache (SDPA) from Python, StaticKvcxCache vs transformers'
   StaticCache from Python and with each step replayed from a CUDA graph; tokens/s after each ``--prompts``
   length (4k and 32k by default; ``--longest-batch-1`` times the longest at batch 1 only), and the cache bytes
   each holds. A cache that fails (not out of memory) is a "failed" cell, its traceback on stderr.
4. Memory held by the packed store vs BF16 keys and values at 32k (section 1's store).
6. With ``--fit [TOKENS ...]`` (CUDA): the most sequences of each length StaticCache and StaticKvcxCache hold
   beside the model, in the device's memory and in 80 GB (an H100's), run first.
5. With ``--variants``: the attention kernel's launch settings (block tokens, warps, FP32 sums or ``tl.dot``)
   timed on one store, to choose its defaults on the GPU at hand; ``--tune`` runs it first and the other
   sections with the fastest setting (named in the table).

Without CUDA the kernels run in Triton's interpreter (``--smoke`` shrinks every shape so that it finishes):
figures from it say nothing about speed, only that every path runs.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time

from bench.gpu_common import (D, HKV, HQ, RESIDUAL, SCHEME, SETTINGS, capture, case, describe,
                              graph_timer, kernel_times, kernels_us, rate, setup_device, steps_per_second, timer, us)

CONTEXTS = (4096, 16384, 32768, 65536, 131072)
BATCHES = (1, 8)


def sdpa_baseline(torch, dev, q, K, V, scale, reps):
    """SDPA over the BF16 keys and values (GQA) through each backend that takes these shapes (flash, cuDNN,
    memory-efficient; the default's choice too): (name, step, median seconds) of the fastest, so that kvcx is
    compared with the best BF16 attention torch has here, not with whatever its dispatcher picks."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def step_with(backend):
        def step():
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, K, V, scale=scale, enable_gqa=True)
        return step

    candidates = [("default", None)]
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend

        candidates += [("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
                       ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    best, want = None, None
    for name, backend in candidates:
        step = step_with(backend)
        try:
            got = step().float()
        except RuntimeError:   # this backend does not take these shapes (or GQA) here
            continue
        want = got if want is None else want
        if float((got - want).norm() / want.norm()) > 1e-2:   # a backend that computes something else is no baseline
            print(f"SDPA backend {name} disagrees with the default; left out", file=sys.stderr)
            continue
        t = timer(torch, dev, step, reps)
        if best is None or t < best[2]:
            best = (name, step, t)
    return best


def reference_errors(torch, store, q, rk, rv, scale, out) -> tuple:
    """(kvcx's error, SDPA-BF16's error): the relative errors (Frobenius) of the fused step's output ``out`` and of
    SDPA in BF16 over the same tokens (the store decoded and rounded to BF16, the residual, the BF16 query: what a
    BF16 model's attention computes over them) vs attention in FP32 over the store decoded to FP32 and the
    residual (the same dequantised values, no BF16 rounding). The fast mode's bar: kvcx's error no larger than
    SDPA-BF16's own."""
    import torch.nn.functional as F

    B, H, D = store.B, store.H, store.D
    K, V = (torch.empty(B, H, store.tokens, D, device=q.device) for _ in "kv")
    store.decode_into("key", K)
    store.decode_into("value", V)
    K, V = torch.cat([K, rk.float()], 2), torch.cat([V, rv.float()], 2)
    qg = q.float().reshape(B, H, -1, D)
    ref = torch.softmax((qg @ K.transpose(-1, -2)) * scale, -1) @ V
    low = F.scaled_dot_product_attention(q.reshape(B, H, -1, D).bfloat16(), K.bfloat16(), V.bfloat16(), scale=scale)
    K = V = None
    norm = ref.norm()
    return float((out.float().reshape(ref.shape) - ref).norm() / norm), float((low.float() - ref).norm() / norm)


PAGE_TOKENS = 64    # the paged store's pages (kvcx.codecs.paged): the smallest that holds the keys' 64-token blocks


def paged_case(torch, dev, cfg, K, V, S: int, shuffled: bool = True):
    """The first S tokens of each row of K and V [B, Hkv, S + residual, d] in a paged store (kvcx.codecs.paged)
    of :data:`PAGE_TOKENS`-token pages handed out in a shuffled order (as an allocator's free list would) or, not
    ``shuffled``, in order (row after row): (pool, block table, seq_lens)."""
    from kvcx.codecs import get_codec, paged

    kc, vc = (get_codec({**c.get_config(), "sinks": 0}).with_backend("triton") for c in (cfg.key, cfg.value))
    B, H = K.shape[:2]
    per_row = -(-S // PAGE_TOKENS)
    pool = paged.allocate(kc, vc, B * per_row, H, K.shape[-1], PAGE_TOKENS, dev)
    order = (torch.randperm(B * per_row, generator=torch.Generator().manual_seed(S)) if shuffled else
             torch.arange(B * per_row)).view(B, per_row)
    for b in range(B):
        paged.write(pool, order[b].tolist(), kc.encode(K[b, :, :S].contiguous()), vc.encode(V[b, :, :S].contiguous()))
    return pool, order.to(torch.int32).to(dev), torch.full((B,), S, dtype=torch.int32, device=dev)


def attention(torch, dev, cfg, contexts, batches, reps, out, hq, hkv, d, launch):
    from kvcx.codecs.paged import attend as paged_attend

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    out("## 1. Decode attention, one layer's step")
    out("")
    out(f"{hq} query heads, {hkv} KV heads, head dim {d}, BF16; kvcx: the {SCHEME} scheme's packed store (+ 1 sink "
        f"and {RESIDUAL} residual tokens) through DevicePackedKV.attend (launch settings: {describe(launch)}); "
        "SDPA: the fastest "
        "of its backends that takes the shapes (named); ratio = baseline / kvcx (> 1: kvcx faster); L2 flushed "
        "before each timed run; graphs: one step captured in a CUDA graph and replayed; errors: kvcx's output, and "
        "SDPA's in BF16 over the same decoded tokens (BF16 query, keys, values and output), each vs attention in "
        "FP32 over the store decoded to FP32 (relative, Frobenius): the fast mode's bar is SDPA-BF16's own error; "
        f"paged: the same tokens (no sink, no residual) in a paged store of {PAGE_TOKENS}-token pages in shuffled "
        "order read through a block table (kvcx.codecs.paged), vs the contiguous store, both from CUDA graphs; "
        "paged in order: the same with the pages in order (the shuffle's cost apart from the table's).")
    out("")
    cols = ["tokens", "batch", "SDPA BF16 (us)", "SDPA backend"] + \
        (["FlashAttention (us)"] if flash_attn_with_kvcache else []) + \
        ["kvcx (us)", "vs SDPA"] + (["vs FlashAttention"] if flash_attn_with_kvcache else []) + \
        ["SDPA graph (us)", "kvcx graph (us)", "vs SDPA, graphs", "BF16 K/V MiB", "kvcx store MiB", "store / BF16",
         "kvcx error", "SDPA-BF16 error", "kvcx within the bar", "kvcx paged graph (us)", "paged / contiguous",
         "paged in order / contiguous"]
    out("| " + " | ".join(cols) + " |")
    out("|" + "---:|" * len(cols))
    memory = {}
    for S in contexts:
        for B in batches:
            q, K, V, store, rk, rv = case(torch, dev, cfg, B, S, hq, hkv, d, seed=S + B)
            scale = d ** -0.5
            kvcx_step = lambda: store.attend(q.view(B, hq, d), rk, rv, None, scale, launch=launch)  # noqa: E731
            err, bar = reference_errors(torch, store, q, rk, rv, scale, kvcx_step())
            t_kvcx = timer(torch, dev, kvcx_step, reps)
            sdpa_name, sdpa_step, t_sdpa = sdpa_baseline(torch, dev, q, K, V, scale, reps)
            row = [f"{S:,}", str(B), f"{t_sdpa * 1e6:.1f}", sdpa_name]
            if flash_attn_with_kvcache:
                kf, vf, qf = K.transpose(1, 2).contiguous(), V.transpose(1, 2).contiguous(), q.transpose(1, 2)
                t_fa = timer(torch, dev, lambda: flash_attn_with_kvcache(qf, kf, vf, softmax_scale=scale), reps)
                row.append(f"{t_fa * 1e6:.1f}")
            row += [f"{t_kvcx * 1e6:.1f}", f"{t_sdpa / t_kvcx:.2f}x"]
            if flash_attn_with_kvcache:
                row.append(f"{t_fa / t_kvcx:.2f}x")
            g_kvcx = graph_timer(torch, dev, kvcx_step, reps)
            g_sdpa = graph_timer(torch, dev, sdpa_step, reps)
            row += [us(g_sdpa), us(g_kvcx), f"{g_sdpa / g_kvcx:.2f}x" if g_sdpa and g_kvcx else "n/a"]
            kv = (K.numel() + V.numel()) * 2
            row += [f"{kv / 2**20:.1f}", f"{store.nbytes / 2**20:.1f}", f"{store.nbytes / kv:.3f}x", f"{err:.1e}",
                    f"{bar:.1e}", "yes" if err <= bar else "NO"]
            for shuffled in (True, False):
                pool, table, lens = paged_case(torch, dev, cfg, K, V, S, shuffled)
                paged_step = lambda: paged_attend(q.view(B, hq, d), pool, table, lens, scale,  # noqa: E731
                                                  launch=launch)
                paged_step()   # once eager (the interpreter's only run)
                g_paged = graph_timer(torch, dev, paged_step, reps)
                row += ([us(g_paged)] if shuffled else []) + \
                    [f"{g_paged / g_kvcx:.2f}x" if g_paged and g_kvcx else "n/a"]
                pool = table = lens = paged_step = None
            memory[(S, B)] = store.nbytes / kv
            out("| " + " | ".join(row) + " |")
            K = V = store = rk = rv = kf = vf = sdpa_step = kvcx_step = None   # released before the next shape
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    out("")
    return memory


def variants(torch, dev, cfg, cases, reps, out, hq, hkv, d):
    """The attention kernel's launch settings (:data:`SETTINGS`, each a
    :class:`~kvcx.codecs.gpu_attn.LaunchSettings` passed to the step it times), each timed on the same store for
    each (tokens, batch) of ``cases``, eager and from a CUDA graph, with its relative error vs FP32 sums and
    SDPA-BF16's own error on the same store (the bar: :func:`reference_errors`). Returns the fastest of those within
    the bar in every case: the smallest sum over the cases of its graph time over the FP32 sums' (each case counts
    alike, batch 8's longer steps no more than batch 1's)."""
    from kvcx.codecs import gpu_attn

    default = gpu_attn.DEFAULT_LAUNCH
    times = {}
    out(f"## 5. Attention kernel settings (the package's default: {describe(default)})")
    out("")
    out("Each row names its setting as `kvcx.codecs.gpu_attn.LaunchSettings` (the fields that differ from the "
        "package's defaults) and spells it out.")
    out("")
    out("| tokens | batch | setting | block tokens | warps | products | prefetch | stages | programs/SM | "
        "register cap | first tile early | merge early | merge warps | merge splits | eager (us) | graph (us) | "
        "rel. error vs FP32 sums | SDPA-BF16 error (the bar) |")
    out("|---:|---:|---|---:|---:|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for S, B in cases:
        q, _, _, store, rk, rv = case(torch, dev, cfg, B, S, hq, hkv, d, seed=S + B)
        q = q.view(B, hq, d)
        def step(setting):
            return store.attend(q, rk, rv, None, d ** -0.5, launch=setting)

        ref = step(SETTINGS[0]).double()
        _, bar = reference_errors(torch, store, q, rk, rv, d ** -0.5, ref)
        base = None
        for setting in SETTINGS:
            try:
                err = float((step(setting).double() - ref).norm() / ref.norm())
                run = functools.partial(step, setting)
                eager, graph = timer(torch, dev, run, reps), graph_timer(torch, dev, run, reps)
                row = [us(eager), us(graph), f"{err:.1e}", f"{bar:.1e}"]
                t = graph if graph is not None else eager
                base = t if base is None else base       # the FP32 sums' time (the first setting)
                if err <= bar:
                    times.setdefault(setting, []).append(t / base)
            except Exception as exc:  # a setting that does not compile or run is a row, not the end of the run
                row = ["failed", f"{type(exc).__name__}", str(exc).splitlines()[0][:60] if str(exc) else "", ""]
            s = setting
            out(f"| {S:,} | {B} | `{s}` | {s.block_tokens} | {s.program_warps(s.dot)} | {s.dot or 'FP32 sums'} | "
                f"{'yes' if s.prefetch else 'no'} | {s.stages or 'default'} | {s.programs_per_sm} | "
                f"{s.max_registers or 'none'} | {'yes' if s.early_tile else 'no'} | {'yes' if s.merge_pdl else 'no'} | "
                f"{s.merge_warps} | {s.merge_splits} | " + " | ".join(row) + " |")
        _ = store = rk = rv = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out("")
    whole = [(sum(t), setting) for setting, t in times.items() if len(t) == len(cases)]
    return min(whole, key=lambda w: w[0])[1] if whole else default


def bandwidth(torch, dev, cfg, shape, reps, out):
    out("## 2. Encode / decode bandwidth vs a device-to-device copy")
    out("")
    out(f"[{', '.join(map(str, shape))}] BF16; GB/s = bytes of the BF16 tensor / median time (1 GB = 1e9 bytes).")
    out("")
    out("| codec | encode GB/s | decode GB/s | copy GB/s | encode / copy | decode / copy | encode kernels GB/s | "
        "decode kernels GB/s | copy kernel GB/s | encode kernels / copy | decode kernels / copy |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    x = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    t_copy = timer(torch, dev, lambda: y.copy_(x), reps)
    copy = nbytes / t_copy / 1e9

    def kernels_gbs(step):
        if dev.type != "cuda":
            return None
        return nbytes / (kernels_us(torch, dev, step) * 1e-6) / 1e9

    # every call timed before any kernel is profiled (the calls' times untouched by whatever a profiler leaves behind)
    calls = []
    from kvcx.codecs import KVConfig

    for label, codec in (("kvcx keys (channel, zero points)", cfg.key), ("kvcx values (token, rotated)", cfg.value),
                         ("kvcx2v values (E8P: rotation, lattice search)", KVConfig.from_scheme("kvcx2v").value),
                         ("kvcx2v keys (widths: group statistics, widths chosen on the host, bit planes)",
                          KVConfig.from_scheme("kvcx2v").key)):
        codec = codec.with_backend("triton")
        p = codec.encode(x)
        calls.append((label, codec, p, timer(torch, dev, lambda: codec.encode(x), reps),
                      timer(torch, dev, lambda: codec.decode(p, y), reps)))
    k_copy = kernels_gbs(lambda: y.copy_(x))
    for label, codec, p, t_enc, t_dec in calls:
        enc, dec = nbytes / t_enc / 1e9, nbytes / t_dec / 1e9
        k_enc, k_dec = kernels_gbs(lambda: codec.encode(x)), kernels_gbs(lambda: codec.decode(p, y))
        kern = [f"{v:.1f}" if v else "n/a" for v in (k_enc, k_dec, k_copy)] + \
            [f"{v / k_copy:.2f}" if v and k_copy else "n/a" for v in (k_enc, k_dec)]
        out(f"| {label} | {enc:.1f} | {dec:.1f} | {copy:.1f} | {enc / copy:.2f} | {dec / copy:.2f} | " +
            " | ".join(kern) + " |")
    out("")


# prompt tokens a forward of the prefill (as engines' chunked prefill: a batch of 8 x 32k tokens in one forward holds
# activations of 262k tokens, which with DynamicCache's or StaticCache's 32 GB of BF16 keys and values and the 16 GB
# of weights did not fit an 80 GB GPU: "out of memory" in the H100 run of 2026-11-27)
PREFILL_CHUNK = 8192


def prefill(torch, dev, model, ids, cache, chunk: int) -> None:
    """The prompt ``ids`` [batch, n] into ``cache``, ``chunk`` tokens a forward (only the last logits computed)."""
    n = ids.shape[1]
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        model(ids[:, s:e], past_key_values=cache, cache_position=torch.arange(s, e, device=dev), logits_to_keep=1)


def graph_rates(torch, dev, model, ids, cache, new_tokens: int, chunk: int = PREFILL_CHUNK):
    """Greedy steps with a cache whose steps can be captured (transformers' StaticCache: SDPA over the preallocated
    BF16 keys and values, masked past the tokens held; kvcx's StaticKvcxCache: the packed store, lengths read on the
    device): (tokens/s launched from Python, tokens/s with each step replayed from a CUDA graph or None off CUDA or
    where the step cannot be captured, the kernels a step launches or None off CUDA). The graph holds a whole step
    (the model, the argmax, the position's increment): a replay is a step, nothing between them."""
    n = ids.shape[1]
    with torch.inference_mode():
        prefill(torch, dev, model, ids, cache, chunk)
        tok = ids[:, -1:].clone()
        pos = torch.tensor([n], device=dev)

        def step():
            logits = model(tok, past_key_values=cache, cache_position=pos).logits
            tok.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)

        step()                             # untimed: first-call set-up
        eager = steps_per_second(torch, dev, step, new_tokens)
        graph = launches = None
        if dev.type == "cuda":
            launches = sum(n for _, n, _ in kernel_times(torch, dev, step, 2))
            try:
                g = capture(torch, step, warmup=1)
                g.replay()
                graph = steps_per_second(torch, dev, g.replay, new_tokens)
            except Exception as exc:   # reported; the table says n/a
                print(f"{type(cache).__name__} step capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return eager, graph, launches


def static_rates(torch, dev, model, ids, new_tokens: int, chunk: int = PREFILL_CHUNK):
    """transformers' StaticCache (:func:`graph_rates`): (tokens/s from Python, from a CUDA graph or None, the
    cache's bytes, kernels a step or None)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 3 * new_tokens + 8)
    eager, graph, launches = graph_rates(torch, dev, model, ids, cache, new_tokens, chunk)
    size = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)
    return eager, graph, size, launches


def static_kvcx_rates(torch, dev, model, ids, new_tokens: int, chunk: int = PREFILL_CHUNK, launch=None):
    """kvcx's StaticKvcxCache (:func:`graph_rates`, the same capacity as StaticCache's): (tokens/s from Python, from
    a CUDA graph or None, the cache's bytes, kernels a step or None); ``launch``: its LaunchSettings."""
    from kvcx.cache.static_cache import StaticKvcxCache

    cache = StaticKvcxCache(model.config, max_cache_len=ids.shape[1] + 3 * new_tokens + 8, launch=launch)
    eager, graph, launches = graph_rates(torch, dev, model, ids, cache, new_tokens, chunk)
    return eager, graph, cache.memory_report()["total_bytes"], launches


def generation(torch, dev, prompts, batches, new_tokens, out, layers, hidden, inter, vocab, hq, hkv,
               chunk: int = PREFILL_CHUNK, launch=None, model=None, longest_batch_1: bool = False):
    """Section 3's table, with ``model`` (one of these shapes) or a new one; ``longest_batch_1``: the longest
    prompt's row at batch 1 only."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out(f"## 3. Greedy decoding, a random-weight model of Llama-3-8B's shape ({layers} layers, hidden {hidden}, "
        f"{hq}/{hkv} heads), {str(dtype).replace('torch.', '')}, greedy, {new_tokens} new tokens timed after one "
        f"untimed step and an untimed row at the first shape (tokens/s: every row's, a batch of "
        f"{' and '.join(map(str, batches))}; the prompt prefilled "
        f"{chunk:,} tokens a forward); DynamicCache "
        "concatenates its whole cache at every step (a copy of all its keys and values a layer and token: why it "
        "is slow); StaticCache preallocates them and attends over all of its length "
        "with a mask (SDPA), from Python and with each step replayed from a CUDA graph (as engines run decode); "
        "KvcxCache (growing packed store) from Python; StaticKvcxCache (kvcx.cache.static_cache: the packed store "
        "allocated for the same capacity as StaticCache's, lengths read on the device) from Python and from a CUDA "
        "graph. The graph columns compare like with like: a whole step (model, argmax, position) replayed; kernels "
        "a step: the launches of a step from Python, profiled (the model's and the cache's; what a replay runs)")
    out("")
    out("| prompt | batch | DynamicCache tok/s | StaticCache tok/s | StaticCache graph tok/s | KvcxCache tok/s | "
        "StaticKvcxCache tok/s | StaticKvcxCache graph tok/s | kvcx graph vs Static graph | KvcxCache vs Dynamic | "
        "DynamicCache MiB | StaticCache MiB | KvcxCache MiB | StaticKvcxCache MiB | StaticKvcxCache / StaticCache | "
        "StaticCache kernels a step | StaticKvcxCache kernels a step | kvcx backend | fused steps |")
    out("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    model = model or llama_model(torch, dev, layers, hidden, inter, vocab, hq, hkv, max(prompts))
    # an untimed row at the first shape: each cache's kernels compiled and the libraries' first calls made at every
    # step a row reaches (the residual filled and packed), which the H200's run of 2026-12-04 timed inside its first
    # row (DynamicCache and KvcxCache both slower at 4k, batch 1 than at 32k)
    generation_row(torch, dev, model, prompts[0], batches[0], new_tokens, vocab, chunk, launch)
    for n, batch in itertools.product(prompts, batches):
        if longest_batch_1 and n == max(prompts) and batch != 1 and len(prompts) > 1:
            continue
        out(generation_row(torch, dev, model, n, batch, new_tokens, vocab, chunk, launch))
    out("")


def llama_model(torch, dev, layers, hidden, inter, vocab, hq, hkv, longest: int):
    """A random-weight Llama of these shapes on ``dev`` (BF16 on CUDA, FP32 elsewhere), attention "kvcx"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcx.cache import kvcx_cache  # noqa: F401  (registers the "kvcx" attention implementation)

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, vocab_size=vocab,
                      num_attention_heads=hq, num_key_value_heads=hkv, max_position_embeddings=longest * 2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):          # initialised where it runs (8B parameters: not through the host)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    model.set_attn_implementation("kvcx")
    return model


def eager_rate(torch, dev, model, ids, cache, new_tokens: int, chunk: int = PREFILL_CHUNK) -> tuple:
    """Greedy steps from Python with ``cache`` after the prompt ``ids`` [batch, n] (prefilled ``chunk`` tokens a
    forward): (tokens/s over all rows, the cache's bytes, KvcxCache's memory report or None)."""
    from kvcx.cache.kvcx_cache import KvcxCache, dynamic_cache_bytes

    with torch.inference_mode():
        # the prompt (its last logits only: all of 32k x 128k in BF16 would be 8 GB) and one untimed step (kernels
        # compiled, libraries' first-call set-up done), then timed steps
        prefill(torch, dev, model, ids, cache, chunk)
        tok = model(ids[:, -1:], past_key_values=cache).logits[:, -1:].argmax(-1)

        def step():
            nonlocal tok
            tok = model(tok, past_key_values=cache).logits[:, -1:].argmax(-1)

        rate = ids.shape[0] * steps_per_second(torch, dev, step, new_tokens)
    if isinstance(cache, KvcxCache):
        rep = cache.memory_report()
        return rate, rep["total_bytes"], rep
    return rate, dynamic_cache_bytes(cache), None


FAILED = "failed"   # a cache whose row raised something other than running out of memory (traceback on stderr)


def measure(torch, dev, what: str, fn):
    """``fn()``'s result; None where it ran out of device memory; :data:`FAILED` where it raised something else (its
    traceback on stderr, named by ``what``: one cache's failure does not cost a row's other figures)."""
    import traceback

    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        return None
    except Exception:   # reported; the row goes on
        print(f"{what}: failed", file=sys.stderr)
        traceback.print_exc()
        return FAILED
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def generation_row(torch, dev, model, n: int, batch: int, new_tokens: int, vocab: int,
                   chunk: int = PREFILL_CHUNK, launch=None) -> str:
    """Section 3's row for a prompt of ``n`` random tokens in each of ``batch`` rows; a cache that runs out of
    device memory (batch 8 at a long prompt) is a cell that says so, one that fails otherwise a cell that says
    "failed" (its traceback on stderr: one cache's failure does not cost the others' figures); the others are
    measured; kvcx's caches launch with ``launch`` (a LaunchSettings, or None: the package's defaults)."""
    from transformers import DynamicCache

    from kvcx.cache.kvcx_cache import KvcxCache

    ids = torch.randint(0, vocab, (batch, n), device=dev)

    def measured(name, fn):
        return measure(torch, dev, f"{name} at {n:,} tokens, batch {batch}", fn)

    dyn = measured("DynamicCache", lambda: eager_rate(torch, dev, model, ids, DynamicCache(), new_tokens, chunk))
    kv = measured("KvcxCache", lambda: eager_rate(
        torch, dev, model, ids, KvcxCache(model.config, backend="triton", launch=launch), new_tokens, chunk))
    st = measured("StaticCache", lambda: static_rates(torch, dev, model, ids, new_tokens, chunk))
    sk = measured("StaticKvcxCache", lambda: static_kvcx_rates(torch, dev, model, ids, new_tokens, chunk, launch))

    def pick(r, i, scale=1.0):   # a measured field, or the row's None (out of memory) / FAILED as it is
        if not isinstance(r, tuple):
            return r
        return None if r[i] is None else r[i] * scale

    def cell(v, f="{:.1f}", missing="out of memory"):
        return missing if v is None else v if v == FAILED else f.format(v)

    def ratio(a, b):
        return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) and b else "n/a"

    # tokens/s over the batch's rows: from Python, and from a graph (None there: the step could not be captured)
    static, skv = pick(st, 0, batch), pick(sk, 0, batch)
    static_graph, skv_graph = pick(st, 1, batch), pick(sk, 1, batch)

    def graph_cell(r, v):
        return cell(v, missing="n/a") if isinstance(r, tuple) else cell(r)

    def launch_cell(r):
        return cell(pick(r, 3), "{:.0f}", missing="n/a") if isinstance(r, tuple) else cell(r)

    bytes_ratio = f"{sk[2] / st[2]:.3f}x" if isinstance(sk, tuple) and isinstance(st, tuple) else "n/a"
    report = kv[2] if isinstance(kv, tuple) else None
    return (f"| {n:,} | {batch} | {cell(pick(dyn, 0))} | {cell(static)} | {graph_cell(st, static_graph)} | "
            f"{cell(pick(kv, 0))} | {cell(skv)} | {graph_cell(sk, skv_graph)} | {ratio(skv_graph, static_graph)} | "
            f"{ratio(pick(kv, 0), pick(dyn, 0))} | "
            f"{cell(pick(dyn, 1, 2**-20))} | {cell(pick(st, 2, 2**-20))} | {cell(pick(kv, 1, 2**-20))} | "
            f"{cell(pick(sk, 2, 2**-20))} | {bytes_ratio} | {launch_cell(st)} | {launch_cell(sk)} | "
            f"{report['backend'] if report else 'n/a'} | {report['attention_steps']['fused'] if report else 'n/a'} |")


def fits(torch, dev, model, make_cache, batch: int) -> bool:
    """Whether ``batch`` rows fit: the cache made by ``make_cache()`` allocated (StaticCache and
    StaticKvcxCache allocate their whole capacity at the first step) and one step of ``batch`` tokens run through
    the model with it; out of device memory -> False."""
    cache = None
    try:
        cache = make_cache()
        with torch.inference_mode():
            ids = torch.zeros((batch, 1), dtype=torch.long, device=dev)
            model(ids, past_key_values=cache, cache_position=torch.arange(1, device=dev), logits_to_keep=1)
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    except RuntimeError as exc:   # an allocation outside torch's allocator (Triton's) says it in its message
        if "out of memory" not in str(exc).lower():
            raise
        return False
    finally:
        del cache
        torch.cuda.empty_cache()


def most_rows(torch, dev, model, make_cache, limit: int = 256) -> int:
    """The largest batch that :func:`fits` (doubling, then bisecting; 0 where one row does not fit)."""
    lo, hi = 0, 1
    while hi <= limit and fits(torch, dev, model, make_cache, hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(torch, dev, model, make_cache, mid) else (lo, mid)
    return lo


def capacity(torch, dev, model, contexts, budgets_gb, out) -> None:
    """Section 6: the most sequences of each length that StaticCache and StaticKvcxCache hold beside the model
    (its BF16 weights) within each memory budget (the device's whole memory, and 80 GB: an H100's, set with
    torch.cuda.set_per_process_memory_fraction)."""
    from transformers import StaticCache

    from kvcx.cache.static_cache import StaticKvcxCache

    total = torch.cuda.get_device_properties(dev).total_memory
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out(f"## 6. Sequences that fit: the largest batch whose cache (allocated whole for the length, as StaticCache "
        f"and StaticKvcxCache allocate it) and one decode step fit beside the model's weights ({weights / 1e9:.1f} "
        f"GB, BF16) within the memory budget (the device's {total / 1e9:.0f} GB, or a smaller budget set with "
        f"torch.cuda.set_per_process_memory_fraction); doubling, then bisecting")
    out("")
    out("| tokens a sequence | memory budget (GB) | StaticCache sequences | StaticKvcxCache sequences | "
        "kvcx / Static |")
    out("|---:|---:|---:|---:|---:|")
    for n, budget in itertools.product(contexts, budgets_gb):
        cap = min(budget * 1e9, total)
        torch.cuda.set_per_process_memory_fraction(cap / total, torch.cuda.current_device())
        try:
            s = most_rows(torch, dev, model, lambda: StaticCache(config=model.config, max_cache_len=n))
            k = most_rows(torch, dev, model, lambda: StaticKvcxCache(model.config, max_cache_len=n))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        out(f"| {n:,} | {cap / 1e9:.0f} | {s} | {k} | {f'{k / s:.2f}x' if s else 'n/a'} |")
    out("")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: every path runs (any device, the interpreter)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per figure (median)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["attention", "bandwidth", "generate"])
    ap.add_argument("--variants", action="store_true",
                    help="also time the attention kernel's launch settings (section 5; for choosing its defaults)")
    ap.add_argument("--tune", action="store_true",
                    help="time the launch settings first (section 5) and run the other sections with the fastest")
    ap.add_argument("--prompts", type=int, nargs="+", default=None,
                    help="section 3's prompt lengths (default 4096 32768; 131072 the issue's longest)")
    ap.add_argument("--gen-batches", type=int, nargs="+", default=None, help="section 3's batches (default 1 8)")
    ap.add_argument("--longest-batch-1", action="store_true",
                    help="section 3's longest prompt at batch 1 only (a batch of 8 at 128k: minutes of prefill)")
    ap.add_argument("--fit", type=int, nargs="*", default=None, metavar="TOKENS",
                    help="section 6: the most sequences of these lengths (default 131072) StaticCache and "
                         "StaticKvcxCache hold beside the model, in the device's memory and in 80 GB")
    ap.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be 1 or more, got {args.reps}")
    for opt, values in (("--prompts", args.prompts), ("--gen-batches", args.gen_batches), ("--fit", args.fit)):
        if values and min(values) < 1:
            ap.error(f"{opt} takes lengths or batches of 1 or more, got {min(values)}")
    torch, dev = setup_device(args.smoke)
    from bench.report import Report

    from kvcx.codecs import KVConfig, gpu_attn

    out = Report()
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "no GPU: Triton's interpreter on the CPU"
    out(f"Device: {name}; torch {torch.__version__}; triton {__import__('triton').__version__}")
    out("")
    cfg = KVConfig.from_scheme(SCHEME)
    t0 = time.perf_counter()
    if args.smoke:
        shapes = dict(contexts=(128, 192), batches=(1, 2), reps=args.reps or 1, hq=4, hkv=2, d=32,
                      bw=(2, 2, 256, 32), prompts=(96,), gen_batches=(1, 2), new=4, model=(2, 128, 256, 256, 4, 2),
                      chunk=64)
    else:
        shapes = dict(contexts=CONTEXTS, batches=BATCHES, reps=args.reps or 50, hq=HQ, hkv=HKV, d=D,
                      bw=(8, 8, 32768, 128), prompts=(4096, 32768), gen_batches=(1, 8), new=32, chunk=PREFILL_CHUNK,
                      model=(32, 4096, 14336, 128256, 32, 8))
    shapes["prompts"] = tuple(args.prompts or shapes["prompts"])
    shapes["gen_batches"] = tuple(args.gen_batches or shapes["gen_batches"])
    memory = {}
    # the cases --tune and --variants time: batch 1 at 32k and 128k tokens, batch 8 at 32k (the targets'), and batch 1
    # at 4k, where a step is mostly its fixed part (the H100's profile of the merge launched early: 14.0 us replayed
    # against the default's 16.8 in an earlier run; not yet timed side by side)
    tune_cases = [(shapes["contexts"][-1], 1)] if args.smoke else [(4096, 1), (32768, 1), (131072, 1), (32768, 8)]
    launch = gpu_attn.DEFAULT_LAUNCH   # what the sections run with: the package's defaults, or the tune's choice
    if args.tune:
        launch = variants(torch, dev, cfg, tune_cases, shapes["reps"], out, shapes["hq"], shapes["hkv"], shapes["d"])
        out(f"The other sections run with the fastest setting within the bar in every case (the smallest sum of "
            f"its graph times over the FP32 sums'): `{launch}`: {describe(launch)}.")
        out("")
    if "attention" not in args.skip:
        memory = attention(torch, dev, cfg, shapes["contexts"], shapes["batches"], shapes["reps"], out,
                           shapes["hq"], shapes["hkv"], shapes["d"], launch)
    if "bandwidth" not in args.skip:
        bandwidth(torch, dev, cfg, shapes["bw"], shapes["reps"], out)
    model = None
    if args.fit is not None and dev.type == "cuda":   # first: a few seconds, where section 3 takes minutes
        model = llama_model(torch, dev, *shapes["model"], max(shapes["prompts"] + tuple(args.fit or [131072])))
        capacity(torch, dev, model, args.fit or [131072], [torch.cuda.get_device_properties(dev).total_memory
                                                           / 1e9, 80], out)
    if "generate" not in args.skip:
        generation(torch, dev, shapes["prompts"], shapes["gen_batches"], shapes["new"], out, *shapes["model"],
                   chunk=shapes["chunk"], launch=launch, model=model, longest_batch_1=args.longest_batch_1)
    if memory:
        S = 32768 if (32768, 1) in memory else shapes["contexts"][-1]
        out(f"## 4. Memory: the packed store holds {memory[(S, 1)]:.3f}x the BF16 keys and values at {S:,} tokens "
            "(batch 1; section 1)")
        out("")
    if args.variants and not args.tune:
        variants(torch, dev, cfg, tune_cases, shapes["reps"], out, shapes["hq"], shapes["hkv"], shapes["d"])
    out(f"Total {time.perf_counter() - t0:.0f} s.")
    if args.markdown:
        out.write(args.markdown, "kvcx on the GPU: fused decode attention, codec bandwidth, generate(), memory "
                                 "(bench/bench_gpu.py).")


if __name__ == "__main__":
    main()
