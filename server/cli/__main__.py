"""``python -m memvit.server.cli``: the ``memvit`` command."""

from . import app

app(prog_name="memvit")
