"""``ladsd serve``: the daemon users run (architecture.md, "`ladsd serve`").

One module per concern:

* :mod:`.daemon`   the Daemon: builds the app and the context, the life cycle, SIGTERM drain
* :mod:`.context`  what handlers see: the settings, sessions, events, admission, the runtime
* :mod:`.app`      aiohttp app: middlewares (errors, keys, loopback guard), limits, JSON bodies
* :mod:`.responses`  JSON and SSE responses; stream writes bounded by a timeout
* :mod:`.errors`   OpenAI's error body and status codes
* :mod:`.chat`     ``/v1/chat/completions`` request parsing (no engine)
* :mod:`.fields`   the chat body's fields refused or ignored
* :mod:`.replies`  tool schemas, the reply parsed back, canonical turns, response bodies
* :mod:`.envelope` the tools-offered JSON output decoded as it streams; JSON depth bounds
* :mod:`.render`   prompt token ids: ChatML turns, token-exact extension of a session's history
* :mod:`.submission`  one request's prompt ids and sampling params, checked
* :mod:`.completions`  the chat and models endpoints: admission, sessions, engine, streaming
* :mod:`.sessions` the bounded session table (TTL) and each session's lease state
* :mod:`.harness`  a session's tool intents (HEAR) and its learned tool waits
* :mod:`.protocol` HEAR's four message kinds: intent, retention control, state, outcomes
* :mod:`.events`   the outcome hub behind ``GET /v1/events``
* :mod:`.metrics`  Prometheus ``GET /metrics``
* :mod:`.agents`   the daemon's own agent runs (:mod:`.agent_run`: one run, its body and view)

Handler modules export their routes (``install(app)``) and read ``app[CONTEXT]``;
none imports :mod:`.daemon`.
"""
