"""The HTTP service: the FastAPI app, what its handlers reach, and the request side of /classify.

Owns ``app`` (``create_app``: the routes, the edge's guard, the lifespan that starts the service),
``state`` (the app's state, and the service once it is ready), ``service`` (a service assembled
around a runner: in one process, or an API process's), ``pipeline`` (POST /classify's request side:
read, check, decode, answer), ``deps`` (the Annotated dependencies routers take), ``schemas`` (the
request and response models), ``openapi`` (the document, every status with its real body) and
``timeouts`` (the deadline for a request's headers, in uvicorn's protocol). The routers are
server/routers/, on the same layer (the app includes them; they take ``deps``). May import every
layer below: ``errors``, ``settings``, ``telemetry``, ``store``, ``registry``, ``tenancy``,
``inference``, ``edge`` and ``oip``; never ``frontend``, ``ray`` or ``cli``, which build on it.
"""
