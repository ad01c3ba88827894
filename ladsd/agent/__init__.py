"""The ReAct web agent: prompts, structured actions, the loop, capture.

``backend`` (how model calls reach the engine: :class:`Backend`,
:class:`DirectBackend`), ``prompt`` (ChatML ids built by exact extension),
``actions`` (per-step schema, parsing), ``loop`` (:func:`run_workflow`),
``capture`` (many tasks at once -> a :class:`~ladsd.workloads.trace.Trace`).
"""
