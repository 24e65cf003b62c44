"""``python -m kvcx`` and the ``kvcx`` console script: the command line, with an error in a setting read while
kvcx loads (``$KVCX_KERNELS`` naming a variant this CPU cannot run, ...) reported as one line and exit 1, as the
commands report theirs, not as a traceback."""
import sys

from kvcx.errors import KvcxError


def main():
    try:
        from kvcx.cli import main as cli_main
    except KvcxError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        sys.exit(1)
    cli_main()


if __name__ == "__main__":
    main()
