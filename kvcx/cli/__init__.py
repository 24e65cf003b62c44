"""The ``kvcx`` command line: thin Typer commands over the library.

The application and what the commands share are in :mod:`kvcx.cli.app`; each command lives in its own module
(:mod:`kvcx.cli.files`: compress, decompress, metrics, info; :mod:`kvcx.cli.validate`; :mod:`kvcx.cli.calibrate`;
:mod:`kvcx.cli.serve`: lmcache-server), imported here to register it. All rendering (rich tables, progress bars,
colours) lives in this package (the tables and bars in :mod:`kvcx.cli.render`); the library reports progress
through callbacks and returns results.
"""
from __future__ import annotations

from kvcx.cli import files, validate, calibrate, serve  # noqa: F401, I001  (each registers its commands on app, in this order)
from kvcx.cli.app import EXIT_ERROR, EXIT_QUALITY, app, in_flags

__all__ = ["app", "main", "in_flags", "EXIT_ERROR", "EXIT_QUALITY"]


def main():  # console-script entry point
    app()


if __name__ == "__main__":
    main()
