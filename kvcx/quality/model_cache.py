"""A GGUF model's conversion kept on disk, so that only the first load pays for it.

transformers reads a GGUF file by parsing all of its metadata (three times: config, tokenizer, weights) and
dequantizing every tensor: about 40 s for the embedded 135M model on 2 cores, at every ``kvcx validate``. The
result of that conversion (FP32 weights as safetensors, the config and the tokenizer) is written once to
``$KVCX_MODEL_CACHE`` (default ``~/.cache/kvcx/models``; ``off`` turns it off) under a name made of the GGUF's
SHA-256 and transformers' version, and read from there afterwards in about a second: the same weights bit for
bit, the same tokens, the same logits (tests/quality/test_model_cache.py).

A cached copy is used only when every file matches the SHA-256 recorded in its manifest (written last, and
the directory appears by one rename): a damaged or partial copy is converted again, never read as a model.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

CACHE_ENV = "KVCX_MODEL_CACHE"
MANIFEST = "kvcx-manifest.json"
_OFF = ("0", "off", "no", "false", "none")


def sha256(path: Path) -> str:
    """The SHA-256 of a file, in hex."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Optional[Path]:
    """The cache's directory, or None where ``$KVCX_MODEL_CACHE`` turns it off (or there is no home)."""
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() in _OFF and setting:
        return None
    if setting:
        return Path(setting).expanduser()
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:       # no home directory to put it in
        return None
    return base / "kvcx" / "models"


def entry_for(gguf_path: str) -> Optional[Path]:
    """The cache entry of a GGUF file (by its contents and transformers' version), or None (cache off)."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    digest = sha256(Path(gguf_path))[:20]
    return root / f"{Path(gguf_path).stem}-{digest}-transformers-{transformers.__version__}"


def verified(entry: Path) -> bool:
    """Whether ``entry`` is complete and every file in its manifest has the recorded SHA-256."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
        return bool(files) and all(sha256(entry / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def write_manifest(tmp: Path) -> None:
    """Write the manifest of a finished directory (the SHA-256 of each file; last, so a partial copy has none)
    and give it and its files the modes mkdir() and open() would."""
    files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=2))
    umask = os.umask(0)
    os.umask(umask)
    for p in tmp.iterdir():
        os.chmod(p, 0o666 & ~umask)
    os.chmod(tmp, 0o777 & ~umask)


def publish(tmp: Path, entry: Path) -> bool:
    """Make the finished directory ``tmp`` the entry ``entry``: its manifest written last, then one rename. False
    where another process's verified copy is already there (kept: a server may be reading it; ``tmp`` is left for
    the caller to remove); a damaged copy is replaced. OSError where the rename fails for another reason."""
    write_manifest(tmp)
    if verified(entry):
        return False
    if entry.exists():
        shutil.rmtree(entry, ignore_errors=True)            # a damaged copy, replaced
    try:
        os.rename(tmp, entry)
    except OSError:
        if verified(entry):                                 # another process finished first
            return False
        raise
    return True


def write_entry(entry: Path, fill) -> bool:
    """Write the entry ``entry`` whole or not at all: ``fill(tmp)`` writes its files into a temporary directory beside
    it, then :func:`publish`; the temporary directory is removed whatever happens. :func:`publish`'s result; what
    ``fill`` or the disk raises passes through."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        fill(tmp)
        return publish(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save(model, tokenizer, entry: Path) -> bool:
    """Write the converted model (FP32 safetensors, config without the GGUF marker, tokenizer) as ``entry``:
    into a temporary directory beside it, the manifest last, then one rename. False where it cannot be
    written (read-only or full disk, another process finished first): the load goes on without the cache."""
    from safetensors.torch import save_model

    def fill(tmp: Path) -> None:
        save_model(model, str(tmp / "model.safetensors"))     # tied weights once
        config = model.config.to_dict()
        config.pop("quantization_config", None)                # GGUF's: the weights here are plain FP32
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(str(tmp))

    try:
        return write_entry(entry, fill)
    except (OSError, RuntimeError, ValueError):   # a cache that cannot be written never stops the load
        return False
