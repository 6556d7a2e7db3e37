"""The class-token path from stored base activations, what training (and evaluation from an
activation cache) runs: capturing a layer's activations (``cached``), reading them in float16 or
bfloat16 (``stored_attention``), the common block written out forward and backward
(``cached_block``, over ``folded_attention``) and every layer's memory projected at once for a
training step (``memory_projection``).

May import: ``memory_core.errors``, ``weights``, ``block``, ``sets``, ``output``. Not ``routing``:
training never runs the slot pass.
"""
