"""kvcx's version (one place; ``kvcx.__version__`` and ``kvcx --version`` read it)."""
VERSION = "0.1.0"
