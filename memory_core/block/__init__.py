"""One transformer block of the fused pass: the base tokens exactly as timm computes them, and the
adapter class tokens beside them, with the torch class-token attention (``class_token_attention``)
that serving's torch path, training from images and the generic cached path all run.

May import: nothing else of memory_core (torch and timm only). Everything that runs a block builds on it.
"""
