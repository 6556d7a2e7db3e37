"""memvit's application layer: the ``memvit`` command line and the HTTP service."""
