"""kvcx's exceptions: one base class, a few children.

Every message names the tensor, key or file concerned and says how to fix it.
The CLI turns any ``KvcxError`` into a red one-line message and exit code 1.
"""


class KvcxError(ValueError):
    """Base class of every error kvcx raises for bad input or setup."""


class CodecError(KvcxError):
    """A tensor or codec setting the INT4 codec cannot handle."""


class KernelImportError(CodecError, ImportError):
    """A kernel variant module this CPU cannot run, imported by name (an ``ImportError`` too, so tools that walk a
    package's modules and skip what cannot be imported skip it)."""


class FormatError(KvcxError):
    """A file that is not valid safetensors, or not a valid kvcx packed file."""


class ModelError(KvcxError):
    """A model, tokenizer or dependency for validation that cannot be had."""


class DatasetError(KvcxError):
    """Evaluation text that cannot be found or is too short."""


class SlowPathWarning(UserWarning):
    """kvcx works, but on a path much slower than the one a setting would give (the message names it)."""
