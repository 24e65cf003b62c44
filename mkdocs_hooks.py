"""MkDocs hook: the CLI reference (docs/reference/cli.md) generated from the Typer app at build time, in
Typer's own Markdown (the text `kvcx COMMAND --help` prints), so it can never drift from the code."""
PLACEHOLDER = "<!-- cli-reference -->"


def on_page_markdown(markdown, page, config, files):
    if PLACEHOLDER not in markdown:
        return markdown
    import typer
    import typer.cli
    import typer.main

    from kvcx.cli import app

    command = typer.main.get_command(app)
    ctx = typer.Context(command)
    ctx.ensure_object(dict)
    ctx.obj[typer.cli.MARKUP_MODE_KEY] = app.rich_markup_mode
    docs = typer.cli.get_docs_for_click(obj=command, ctx=ctx, name="kvcx", title="Commands")
    return markdown.replace(PLACEHOLDER, docs.strip().replace("\n# ", "\n## "))


def on_config(config):
    """The kernel variants this CPU cannot run (kvcx.codecs.cpu.VARIANTS, e.g. x86-64-v4 on a CPU without AVX-512)
    are built beside the others, and the API reference's loader (griffe) imports every submodule it finds: importing
    one runs its module init, compiled for the other instruction set, and the build dies of SIGILL. They are private
    (the reference filters ``_`` names out), so the build sees each of them as an empty module instead; kvcx itself
    never imports them on such a CPU (``kvcx.codecs.cpu.choose``)."""
    import sys
    import types

    from kvcx.codecs import cpu

    for name, (mod, _) in cpu.VARIANTS.items():
        full = f"{cpu.__name__}.{mod}"
        if cpu.missing(name) and full not in sys.modules:
            sys.modules[full] = types.ModuleType(full, f"kvcx's {name} kernels: not importable on this CPU")
    return config
