"""A stable identity for a set of base weights.

An adapter is trained against one exact base; served on top of any other weights, its logits would
be silently wrong. Bundles therefore carry the fingerprint of their base, and loading compares it.

The fingerprint is sha256 over the state dict in sorted name order; for each tensor it hashes a
header line ``name|shape|dtype\\n`` and then its bytes (C order). Floating-point tensors are hashed
as float32, so the same weights give the same fingerprint before and after the engine casts them
to bfloat16 or moves them to a GPU (the engine fingerprints the weights it was given, once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor


def state_fingerprint(state: Mapping[str, Tensor]) -> str:
    """Hex sha256 of ``state`` (a model's ``state_dict()``)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu")
        if t.is_floating_point():
            t = t.to(torch.float32)
        t = t.contiguous()
        digest.update(f"{name}|{tuple(t.shape)}|{str(t.dtype).removeprefix('torch.')}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
