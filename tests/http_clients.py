"""One default SSL context for every httpx client the tests make (``share_default_ssl_context``).

httpx builds a new ``ssl.SSLContext`` for every client, loading certifi's CA bundle each time (~55
ms of CPU on the 2-core CI machine), and ``httpx.get``/``post`` make a client per call. The tests make
thousands, all over plain http to loopback servers: test_api, test_origin and test_tenants alone
made 240 contexts, 13 of their 45 seconds. An ``SSLContext`` is made to be shared; the shared one is
the one httpx would build (the same arguments, the same CA bundle), so any https request would be
checked the same way. Contexts asked for with other arguments are built as before.
"""

from __future__ import annotations

import functools


def share_default_ssl_context() -> None:
    try:
        from httpx._transports import default
    except ImportError:  # httpx absent, or laid out otherwise: every client builds its own
        return
    build = getattr(default, "create_ssl_context", None)
    if build is None or getattr(build, "shared_default", False):
        return

    @functools.cache
    def built_once():
        return build()

    @functools.wraps(build)
    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env is True:
            return built_once()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context.shared_default = True
    default.create_ssl_context = create_ssl_context
