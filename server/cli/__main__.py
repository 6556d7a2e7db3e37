"""``python -m server.cli``: the ``memvit`` command."""

from . import app

app(prog_name="memvit")
