"""Optional dependencies and their versions: one place that every module may use.

Imports nothing heavy itself: each check imports (or only locates) what it checks.
"""
from __future__ import annotations

import importlib.util

from kvcx.errors import ModelError

SUPPORTED_TRANSFORMERS = ("5.0", "5.24")  # [min, max)
TORCH_PIN = "torch==2.13.0"
VALIDATE_EXTRA = f"pip install {TORCH_PIN} 'transformers>={SUPPORTED_TRANSFORMERS[0]},<{SUPPORTED_TRANSFORMERS[1]}' " \
                 "gguf accelerate (or kvcx[validate], or `make venv`)"


def check_transformers_version(version: str) -> None:
    """ModelError unless ``version`` is in the supported transformers range."""
    from packaging.version import Version

    lo, hi = SUPPORTED_TRANSFORMERS
    if not Version(lo) <= Version(version) < Version(hi):
        raise ModelError(f"transformers {version} is not supported; kvcx works with >={lo},<{hi}: "
                         f"pip install 'transformers>={lo},<{hi}'")


def import_torch():
    """The torch module, or ModelError saying how to install it."""
    try:
        import torch
    except ImportError:
        raise ModelError(f"this needs PyTorch: pip install {TORCH_PIN} (or `make venv`)") from None
    return torch


def require_torch_transformers() -> None:
    """Import torch and transformers (checking the version), or raise ModelError saying how to install them."""
    try:
        import torch  # noqa: F401 - imported to check it is there
        import transformers
    except ImportError as exc:
        raise ModelError(f"this needs torch and transformers ({exc.name} is missing): {VALIDATE_EXTRA}") from None
    check_transformers_version(transformers.__version__)


def require_modules(*names: str, purpose: str) -> None:
    """ModelError naming the first of ``names`` that is not installed (located, not imported)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ModelError(f"{purpose} needs the {name!r} package: pip install {name}")
