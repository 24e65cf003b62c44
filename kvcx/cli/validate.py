"""``kvcx validate``: the quality gate (perplexity, or passkey retrieval), one setting or several."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvcx.cli.app import (EXIT_QUALITY, FLAG, BitsOpt, DeviceOpt, GroupOpt, JsonOpt, KeysBeforeRopeOpt, PlanOpt,
                          RotateOpt, SchemeOpt, SinksOpt, ThreadsOpt, check_files_first,
                          cli_errors, app)
from kvcx.cli.render import (emit_json, out, print_phase, print_retrieval, print_validation, print_validations,
                             window_bar)


@app.command()
def validate(
    threshold: Annotated[float, typer.Option(help="PASS when the perplexity delta is below this (KVQuant: 0.5).")] = 0.5,
    model: Annotated[Optional[str], typer.Option(help="HF id, local dir or .gguf (default: embedded SmolLM2-135M).")] = None,
    dataset_file: Annotated[Optional[Path], typer.Option("--dataset-file", help="WikiText-2 raw test text file.")] = None,
    window: Annotated[Optional[int], typer.Option(help="Tokens per window (default 1024 or the model's context).")] = None,
    stride: Annotated[int, typer.Option(help="Tokens scored per window; the rest is the compressed context.")] = 512,
    max_windows: Annotated[int, typer.Option("--max-windows", help="Windows to evaluate (0 = whole test set).")] = 32,
    group_size: GroupOpt = None,
    scheme: SchemeOpt = "kvcx",
    bits: BitsOpt = None,
    sinks: SinksOpt = None,
    rotate: RotateOpt = None,
    mode: Annotated[str, typer.Option(help="prefix: compress the context cache once; generation: through KvcxCache "
                                           "as the model runs; engine: every key/value, the current token's included, "
                                           "through the codec before attention (vLLM, llama.cpp).")] = "prefix",
    cpu: Annotated[bool, typer.Option("--cpu", metavar=FLAG, help="Force CPU even when CUDA is available.")] = False,
    device: DeviceOpt = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="Where kvcx compresses the cache: triton (on "
                                                                     "the GPU; 4-bit integer, E8P and widths codecs) "
                                                                     "or cpu (default: by the model's device).")] = None,
    plan: PlanOpt = None,
    keys_before_rope: KeysBeforeRopeOpt = False,
    threads: ThreadsOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", metavar=FLAG, help="Only the verdict line.")] = False,
    quick_test: Annotated[bool, typer.Option("--quick-test", metavar=FLAG, help="No model: a synthetic TinyLlama-shaped cache, "
                                                                  "judged on RMSE/SNR/cosine.")] = False,
    gate: Annotated[Optional[str], typer.Option("--gate", help="With several --scheme settings: the ones that must "
                                                               "pass for exit 0 (comma-separated; default: all).")] = None,
    pareto: Annotated[Optional[Path], typer.Option("--pareto", help="Also draw bits/value vs perplexity delta of "
                                                                    "every setting to this PNG (needs kvcx\\[plot]).")] = None,
    task: Annotated[str, typer.Option("--task", help="perplexity (default); ruler: retrieval tasks made from "
                                                     "templates (RULER's needles, variable tracking, common words; "
                                                     "--tasks picks); passkey: a key hidden in long contexts.")] = "perplexity",
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="ruler: the tasks, comma-separated (default: all "
                                                                 "of niah_single, niah_multikey, niah_multivalue, "
                                                                 "niah_multiquery, vt, cwe).")] = None,
    lengths: Annotated[Optional[str], typer.Option("--lengths", help="ruler/passkey: context lengths, comma-separated "
                                                                     "(default 1024, 2048, ... the model's context).")] = None,
    depths: Annotated[Optional[str], typer.Option("--depths", help="ruler/passkey: where the needle sits, fractions "
                                                                   "of the context (default 0.1,0.3,0.5,0.7,0.9).")] = None,
    prompts: Annotated[int, typer.Option("--prompts", help="ruler/passkey: prompts per task, length and depth.")] = 2,
    alpha: Annotated[float, typer.Option("--alpha", help="ruler/passkey: a setting fails where it is below the exact "
                                                         "cache at this family-wise significance (McNemar, Holm).")] = 0.05,
    seed: Annotated[int, typer.Option("--seed", help="ruler/passkey: the prompts' seed.")] = 0,
    query_aware: Annotated[bool, typer.Option("--query-aware", metavar=FLAG, help="ruler/passkey: prefill the question with the "
                                                                    "context, so a press (SnapKV's window) sees it "
                                                                    "(default: the context compressed before the "
                                                                    "question is known, as a prefix cache holds it).")] = False,
    tolerance: Annotated[Optional[int], typer.Option("--tolerance", hidden=True)] = None,
    json_out: JsonOpt = False,
):
    """Perplexity with the exact vs the compressed KV cache on WikiText-2 (exit 3 when delta >= threshold).

    Several settings in one pass: --scheme kvcx,q4_0-rot,fp8_e4m3 scores the baseline once and every setting
    on the same windows and tokens (one table; --json a list). --task ruler / passkey: retrieval at long contexts,
    each setting against the exact cache on the same prompts; a press composes by '+' (kvcx+snapkv:0.5)."""
    with cli_errors("validate"):
        from kvcx.quality import validation

        check_files_first(plan=plan, dataset=dataset_file, outputs=[(pareto, "picture")] if pareto is not None else [],
                     sidecars=False)
        from kvcx.api import validation_settings

        from kvcx.quality.peers import PEERS

        configs, gated = validation_settings(scheme, plan, gate, group_size, bits, sinks, rotate, threads, peers=PEERS,
                                             keys_before_rope=keys_before_rope)
        on_phase = None if (json_out or quiet) else print_phase
        from kvcx.presses import PressedSetting
        from kvcx.quality import ranks
        from kvcx.quality.request import ValidateRequest

        request = ValidateRequest(task=task, tasks=tasks, lengths=lengths, depths=depths, query_aware=query_aware,
                                  alpha=alpha, mode=mode, backend=backend, quick_test=quick_test, tolerance=tolerance,
                                  device=device, keys_before_rope=keys_before_rope,
                                  pressed=tuple(label for label, c in configs.items() if isinstance(c, PressedSetting)))
        request.check()
        if ranks.follows():   # rank 0 reports; the other ranks score their windows quietly
            on_phase, quiet = None, True
        if request.retrieval:
            return _retrieval(configs, gated, request, prompts, seed, model, dataset_file, cpu, quiet, json_out,
                              on_phase)
        if quick_test:
            results = [validation.quick_test(c, on_phase=on_phase, label=label) for label, c in configs.items()]
        else:
            with window_bar(quiet) as on_window:
                results = validation.run_validations(
                    configs, threshold=threshold, model=model, dataset_file=dataset_file, window=window,
                    stride=stride, max_windows=max_windows, mode=mode, cpu=cpu, device=device, on_phase=on_phase,
                    on_window=on_window, backend=backend)
        if not results:   # a rank other than 0: its windows went to rank 0
            return
        if pareto is not None:
            from kvcx.quality.plots import validation_pareto

            validation_pareto(results, pareto, title=f"{results[0].model}: {results[0].tokens_scored:,} tokens, "
                                                     f"windows of {results[0].window} ({results[0].mode} mode)")
    if len(results) == 1:
        result = results[0]
        if json_out:
            emit_json(result.to_dict())
        elif quiet:
            out.print(result.verdict_line())
        else:
            print_validation(result)
    elif json_out:
        emit_json([r.to_dict() for r in results])
    else:
        print_validations(results, gated, quiet)
    if any(not r.passed for r in results if r.setting in gated or len(results) == 1):
        raise typer.Exit(code=EXIT_QUALITY)


def _retrieval(configs, gated, request, prompts, seed, model, dataset_file, cpu, quiet, json_out, on_phase):
    from kvcx.quality import retrieval
    from kvcx.quality.models import context_length, resolve_model

    names, parsed, where = request.retrieval_tasks(), request.retrieval_lengths(), request.retrieval_depths()
    # every option checked before the model loads (its context read from its config or GGUF, not loaded)
    retrieval.check_retrieval(names, parsed or [1024], where or retrieval.DEPTHS, prompts,
                              context_length(resolve_model(model)) if parsed else None)
    with window_bar(quiet, "prompts") as on_prompt:
        results = retrieval.run_retrieval(configs, names, lengths=parsed, depths=where or retrieval.DEPTHS,
                                          prompts=prompts, seed=seed, model=model, dataset_file=dataset_file,
                                          cpu=cpu, device=request.device, alpha=request.alpha, on_phase=on_phase,
                                          on_prompt=on_prompt,
                                          task_label=request.task, query_aware=request.query_aware)
    if not results:   # a rank other than 0: its prompts' answers went to rank 0
        return
    if json_out:
        emit_json(results[0].to_dict() if len(results) == 1 else [r.to_dict() for r in results])
    else:
        print_retrieval(results, gated, quiet)
    if any(not r.passed for r in results if r.setting in gated):
        raise typer.Exit(code=EXIT_QUALITY)
