"""The batch-invariant mode: passes whose every call has a shape fixed by neither the batch nor the
adapter set, so an image's logits are bit-identical whatever shares its pass. ``blocks`` (the fixed
call sizes), ``attention`` (the class-token attention of this mode), ``mode`` (its passes over a
stack) and ``planned`` (over slot pools, with the Triton kernel at one row per program).

May import: ``memory_core.errors``, ``weights``, ``block``, ``sets``, ``output``, ``routing``.
"""
