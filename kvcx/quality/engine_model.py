"""A model as a serving engine loads it: a Hugging Face checkpoint directory, written once from a GGUF.

vLLM serves Hugging Face checkpoints. :func:`engine_checkpoint` writes one for the embedded SmolLM2 GGUF (or any
GGUF transformers reads): BF16 safetensors with the tied embedding under the name engines look for
(``model.embed_tokens.weight``), a ``config.json`` with its ``architectures``, and the tokenizer. It is kept
beside the conversions of :mod:`kvcx.quality.model_cache` (``$KVCX_MODEL_CACHE``), checked by the SHA-256 of
every file (a manifest written last, the directory appearing by one rename), and written again when damaged.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from kvcx.errors import ModelError
from kvcx.quality import model_cache
from kvcx.quality.models import load_model_and_tokenizer, resolve_model

ENGINE_SUFFIX = "-engine-bf16"


def engine_checkpoint(model: Optional[str] = None, root: Optional[os.PathLike] = None) -> Path:
    """The directory of an engine-ready checkpoint of ``model`` (None: the embedded GGUF; a ``.gguf`` path),
    written on the first call. ``root``: where to keep it (default: the model cache's directory)."""
    src = resolve_model(model)
    gguf = src.kwargs.get("gguf_file")
    if not gguf:
        raise ModelError(f"{src.name}: an engine checkpoint is written from a GGUF file; a model directory or "
                         "Hugging Face id is already one (pass it to the engine as it is)")
    base = Path(root) if root is not None else model_cache.cache_root()
    if base is None:
        raise ModelError(f"the model cache is off (${model_cache.CACHE_ENV}); pass root= a directory to keep the "
                         "engine checkpoint in")
    import transformers

    path = os.path.join(src.source, gguf)
    digest = model_cache.sha256(Path(path))[:20]
    entry = base / f"{Path(gguf).stem}-{digest}-transformers-{transformers.__version__}{ENGINE_SUFFIX}"
    if model_cache.verified(entry):
        return entry
    m, tok, _ = load_model_and_tokenizer(src, cpu=True)
    _write(m, tok, entry)
    return entry


def _write(model, tokenizer, entry: Path) -> None:
    import torch
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            emb = model.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
            state["model.embed_tokens.weight"] = emb          # engines tie lm_head to this name
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(str(tmp))

    try:
        model_cache.write_entry(entry, fill)     # another process's verified copy is kept, a damaged one replaced
    except OSError as exc:
        raise ModelError(f"{entry}: cannot write the engine checkpoint ({exc.strerror or exc}); pass root= a "
                         "writable directory") from None
