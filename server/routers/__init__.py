"""The HTTP routes, thin: each reads its request through ``deps`` (server/http/deps.py) and answers
from the service. On the HTTP layer with server/http/ (the app includes them); may import every layer
below it, never ``frontend``, ``ray`` or ``cli``.
"""
