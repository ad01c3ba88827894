"""``ladsd serve``: the daemon users run (architecture.md, "`ladsd serve`").

One module per concern:

* :mod:`.daemon`   the Daemon: one ``open_runtime`` kept open, the HTTP server, SIGTERM drain
* :mod:`.app`      aiohttp app: middlewares (errors, keys, loopback guard), limits, JSON, SSE
* :mod:`.errors`   OpenAI's error body and status codes
* :mod:`.chat`     ``/v1/chat/completions`` request parsing, tool schemas, replies (no engine)
* :mod:`.envelope` the tools-offered JSON output decoded as it streams; JSON depth bounds
* :mod:`.render`   prompt token ids: ChatML turns, token-exact extension of a session's history
* :mod:`.completions`  the chat and models endpoints: admission, sessions, engine, streaming
* :mod:`.sessions` the bounded session table (TTL) and each session's lease state
* :mod:`.protocol` HEAR's four message kinds: intent, retention control, state, outcomes
* :mod:`.events`   the outcome hub behind ``GET /v1/events``
* :mod:`.metrics`  Prometheus ``GET /metrics``
* :mod:`.agents`   the daemon's own agent runs
"""
