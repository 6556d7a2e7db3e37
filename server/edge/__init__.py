"""The HTTP edge: every rule a request meets before a route reads it, in one place.

- ``routes.py``: the one table. For each route (method + path template): who may call it, whether it
  changes state, how many bytes its body may hold and how long it may take to arrive.
- ``guard.py``: ``GuardMiddleware``, the pure ASGI middleware that applies the table (``create_app``
  always installs it, and refuses to build an app with a route the table lacks).
- ``origin.py``: the Host header (every request) and, for changes, the page that sent it (Origin,
  Sec-Fetch-Site): DNS rebinding and other sites' pages.
- ``principal.py``: who is calling (the admin token, a tenant's key, anonymous), resolved once.
- ``access.py``: who may call a route (admin, read and public rules), from the headers alone.
- ``body.py``: the body cap and deadline, in one receive/send wrapper; the per-file read cap.
- ``errors.py``: every error's status (``status_of``) and the FastAPI handlers that answer them.
- ``send.py``: the one error shape and ``send_error`` for every ASGI-level refusal (no torch: the
  Ray proxy imports it).

Nothing is imported here, so that ``memvit.server.edge.send`` stays light for the Ray proxy.

May import ``errors``, ``settings``, ``telemetry``, ``store``, ``registry`` and ``tenancy`` (who a
key is, its limits); never the inference loop, the app (server/http/) or the routers.
"""
