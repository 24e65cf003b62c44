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

