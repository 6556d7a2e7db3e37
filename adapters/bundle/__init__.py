"""The bundle format (``memvit.adapter/1``): one safetensors file per adapter (``format``: writing
it, ``AdapterBundle``), strict reading (``reader``), its errors (``errors``) and attaching a bundle
to an engine (``attach``).

May import: ``memvit.memory_core`` and ``adapters.files`` (durable writes). Never ``training``.
"""
