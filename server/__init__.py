"""memvit's application layer: the ``memvit`` command line and the HTTP service.

Its packages, lowest layer first; a module imports its own layer and those before it, never one
after (tests/test_import_graph.py, ``SERVER_LAYERS``, checks it):

1. ``errors`` (the named errors), ``settings`` (read once from the environment), ``telemetry``
   (metrics, request stages, task labels) and ``demo`` (the embedded demo's files): import nothing
   of memvit.server.
2. ``store``: where adapter bundles and the registry's journal are kept (a directory or S3).
3. ``registry``: which adapters exist (the catalog) and which are resident on the device.
4. ``tenancy``: API keys, policies, limits, usage and the audit log.
5. ``inference``: the inference loop (decoding, the engine loop, the device runner, answers, the
   runner a request side calls). No HTTP here.
6. ``edge`` (every rule a request meets before a route, and every error's HTTP response) and
   ``oip`` (the Open Inference Protocol's wire format).
7. ``http`` (the FastAPI app, its state and service, /classify's request side) and ``routers``
   (thin routes).
8. ``frontend`` (several processes on one port, and the link between them) and ``ray`` (Ray Serve).
9. ``cli`` (the ``memvit`` command), and the shims ``ray_serve``, ``ray_router`` and ``ray_proxy``
   (the old import paths Ray deployments name).
"""
