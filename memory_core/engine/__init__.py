"""The engine: ``MemoryViT`` (a frozen timm ViT plus the adapters of whichever set it is handed, in
one fused pass), how it prepares adapters (``preparation``) and which set is live (``live``).

May import every other room of memory_core: it picks the pass (routing, invariant, stored) and runs
it. Nothing else in memory_core imports it.
"""
