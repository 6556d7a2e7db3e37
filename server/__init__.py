"""memvit's application layer: the command line (and, with issue #4, the HTTP service)."""
