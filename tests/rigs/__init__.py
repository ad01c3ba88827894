"""Rigs shared by the test modules (no tests here; no test module imports another).

``leases``: the lease scheduler rig (vLLM's real scheduler, no model); ``policy``: the
delivery-policy rig (pending results, views, recording policies, prepared frames);
``runs``: run records on plain data; ``engine``: the real-engine rigs (histories for the
tiny model, a notice the engine thread is held in); ``server``: the ``ladsd serve``
module rig (``tests/helpers.py`` holds the smaller serve helpers).
"""
