"""What the server measures: Prometheus metrics, a request's six stages, the bounded task labels.

Owns ``metrics`` (one Prometheus registry per app, its ASGI middleware), ``stages`` (where a request's
time goes) and ``task_labels`` (which tasks get their own series). Imports nothing of memvit.server:
every other package may count through it.
"""
