"""Optional dependencies and what kvcx needs of them: one place that every module may use.

Imports nothing heavy itself: each check imports (or only locates) what it checks.

kvcx asks transformers for features, not for a version: :data:`TRANSFORMERS_FEATURES` lists what it reaches for
inside transformers (the cache classes it builds on, the attention and mask interfaces it registers with). A
release that keeps them runs; one that moved or dropped one is refused with an error naming it. The only version
check is the floor below which those features never existed (:data:`MIN_TRANSFORMERS`).
"""
from __future__ import annotations

import importlib
import importlib.util

from kvcx.errors import ModelError

MIN_TRANSFORMERS = "5.0"
MIN_TORCH = "2.4"
# (module, name, what kvcx uses it for): checked by require_torch_transformers() before a model is loaded
TRANSFORMERS_FEATURES = (
    ("transformers.cache_utils", "Cache", "the base class of KvcxCache"),
    ("transformers.cache_utils", "DynamicLayer", "the base class of KvcxCache's layers"),
    ("transformers.cache_utils", "CacheLayerMixin", "the base class of StaticKvcxCache's layers"),
    ("transformers.cache_utils", "DynamicCache", "the exact cache validation compares against"),
    ("transformers.modeling_utils", "AttentionInterface", "registering kvcx's fused attention"),
    ("transformers.masking_utils", "AttentionMaskInterface", "registering kvcx's attention mask"),
    ("transformers.masking_utils", "sdpa_mask", "the mask kvcx's attention reads"),
    ("transformers.integrations.sdpa_attention", "sdpa_attention_forward", "the attention of non-kvcx steps"),
)
INSTALL = f"pip install 'torch>={MIN_TORCH}' 'transformers>={MIN_TRANSFORMERS}' gguf accelerate (or kvcx[validate], " \
          "or `make venv`)"


def check_transformers(version: str) -> None:
    """ModelError where the installed transformers lacks what kvcx uses (naming it), or is older than the floor."""
    from packaging.version import Version

    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ModelError(f"transformers {version} is older than kvcx needs (>={MIN_TRANSFORMERS}: its cache and "
                         f"attention interfaces): pip install 'transformers>={MIN_TRANSFORMERS}'")
    for module, name, use in TRANSFORMERS_FEATURES:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            raise ModelError(f"transformers {version} has no {module}.{name}, which kvcx uses for {use}; this "
                             "release changed it: install one that has it (kvcx is tested on the newest "
                             "transformers in CI) or report it to kvcx")


def cache_keyword(fn) -> str:
    """The keyword a transformers model's ``forward`` or ``generate`` takes its cache by: ``cache`` where the
    installed release has it (newer releases; ``past_key_values`` is deprecated there), else ``past_key_values``.
    Read from the signature, not the version."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def decoder_of(model):
    """A causal LM's decoder, the module that returns hidden states (its ``last_hidden_state``): transformers'
    ``get_decoder()``, except where that lookup returns the causal LM itself (Llama 4's text model, whose
    ``base_model_prefix`` names no attribute of it), then the LM's ``model``."""
    decoder = model.get_decoder()
    if decoder is model and getattr(model, "model", None) is not None:
        return model.model
    return decoder


def output_cache(output):
    """The cache a transformers model output carries (``.cache`` in newer releases, ``.past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def import_torch():
    """The torch module, or ModelError saying how to install it."""
    try:
        import torch
    except ImportError:
        raise ModelError(f"this needs PyTorch: pip install 'torch>={MIN_TORCH}' (or `make venv`)") from None
    return torch


def require_torch_transformers() -> None:
    """Import torch and transformers and check what kvcx uses of them, or raise ModelError saying what to do."""
    try:
        import torch  # noqa: F401 - imported to check it is there
        import transformers
    except ImportError as exc:
        raise ModelError(f"this needs torch and transformers ({exc.name} is missing): {INSTALL}") from None
    check_transformers(transformers.__version__)


def require_modules(*names: str, purpose: str) -> None:
    """ModelError naming the first of ``names`` that is not installed (located, not imported)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ModelError(f"{purpose} needs the {name!r} package: pip install {name}")
