"""Adapters prepared for an engine, and the immutable sets a pass runs: ``PreparedAdapter`` and the
stacked tensors of many (``AdapterStack``), ``AdapterSet`` (a versioned snapshot), and a batch's
tasks as set positions (``TaskIndex``).

May import: ``memory_core.errors``, ``weights``, ``block``. Nothing here runs a pass.
"""
