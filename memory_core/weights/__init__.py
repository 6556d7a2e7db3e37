"""What is loaded, before anything runs: the base ViT (its spec, weights, fingerprint, FLOPs) and an
adapter's weights (``AdapterWeights``: class token, memory, head, and the checks on them).

May import: ``memory_core.errors`` only (and torch, timm, safetensors). Everything else builds on it.
"""
