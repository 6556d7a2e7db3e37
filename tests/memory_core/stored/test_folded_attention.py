"""A frozen attention folded into two linear layers (memory_core/stored/folded_attention.py): one query's
attention over rows as timm's projections compute it, and the folds kept only while the weights are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention

from memvit.memory_core.stored.folded_attention import folded

D, H = 12, 3


def _attention(qkv_bias: bool, proj_bias: bool) -> Attention:
    torch.manual_seed(0)
    attn = Attention(D, num_heads=H, qkv_bias=qkv_bias, proj_bias=proj_bias).double().requires_grad_(False)
    if qkv_bias:  # timm initialises biases to zero: make every term count
        attn.qkv.bias.normal_()
    return attn


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("proj_bias", [True, False])
def test_the_folds_give_one_querys_attention_over_rows(qkv_bias: bool, proj_bias: bool) -> None:
    attn = _attention(qkv_bias, proj_bias)
    x, rows = torch.randn(D, dtype=torch.float64), torch.randn(7, D, dtype=torch.float64)
    # timm's projections: the query from x, keys and values from the rows, per head
    q = attn.qkv(x)[:D].view(H, -1)
    _, k, v = attn.qkv(rows).view(7, 3, H, -1).permute(1, 2, 0, 3)  # each (H, 7, d)
    p = ((q[:, None] * k).sum(-1) * attn.scale).softmax(-1)  # (H, 7)
    want = attn.proj((p[..., None] * v).sum(1).reshape(D))
    # folded: H query rows of width D, read against the rows themselves
    f = folded(attn)
    u = F.linear(x, f.query_key, f.query_key_bias).view(H, D)
    ph = (u @ rows.T).softmax(-1) @ rows  # (H, D)
    got = F.linear(ph.reshape(H * D), f.value_out, f.value_out_bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_folds_are_kept_until_the_weights_change() -> None:
    attn = _attention(True, True)
    first = folded(attn)
    assert folded(attn) is first
    with torch.no_grad():
        attn.qkv.weight.mul_(2)  # in place: the same storage, a new version
    second = folded(attn)
    assert second is not first
    torch.testing.assert_close(second.query_key, 4 * first.query_key)  # q and k both doubled
    attn.float()
    assert folded(attn).query_key.dtype == torch.float32


def test_a_base_that_is_being_trained_is_refused() -> None:
    attn = _attention(True, True).requires_grad_(True)
    with pytest.raises(ValueError, match="frozen base"):
        folded(attn)
