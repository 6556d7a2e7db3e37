"""memvit on Ray Serve: the deployment, its request router, and the proxy's middlewares.

Owns ``serve`` (the deployment: N replicas of the HTTP app, ``app`` for ``serve run``), ``router``
(``AdapterAffinityRouter``: a request for an adapter to the replica that holds it), ``affinity``
(the routing key read from a request in the proxy), ``proxy`` (a replica lost mid-request answered
with 503 + Retry-After) and ``handover`` (a replica's requests handed over as it drains). Only this
package imports ray (the ``ray`` extra). May import every layer below it (the HTTP app in the replica);
``affinity``, ``proxy`` and ``router`` run in Ray's proxy and controller, so they import neither torch
nor the app. The old paths deployments name (``memvit.server.ray_serve:app``,
``memvit.server.ray_router:AdapterAffinityRouter``, ``memvit.server.ray_proxy:proxy_middlewares``)
are kept as shims in server/.
"""
