"""``kvcx lmcache-server``: LMCache's multiprocess server with the kvcx serde registered in its process."""
from __future__ import annotations


import typer

from kvcx.cli.app import (cli_errors, app)


@app.command("lmcache-server", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lmcache_server(ctx: typer.Context):
    """Run LMCache's multiprocess server with the kvcx serde registered; every flag goes to [bold]lmcache
    server[/] (see its --help). A kvcx serde in an --l2-adapter is checked before the server starts.

    Example: kvcx lmcache-server --port 5555 --supported-transfer-mode auto --eviction-policy LRU
    --l2-adapter '{"type": "fs", "base_path": "/cache", "serde": {"type": "kvcx", "layout": "vllm_cpu",
    "block_size": 128}}'
    """
    with cli_errors():
        from kvcx.integrations.lmcache import check_server_args, run_server

        check_server_args(ctx.args)
    run_server(ctx.args)


