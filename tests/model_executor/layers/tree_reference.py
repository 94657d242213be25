"""Dense attention of one tree request, the reference both attention paths are checked against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_tree_reference(q, keys, values, cached, masks, scale, window=None, positions=None):
    """Row i sees the cached keys and the tree slots its mask allows (its ancestors); with
    ``window``, only keys within ``window`` positions of its own (``positions``: each row's)."""
    new = len(masks)
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, ctx, hd]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    allowed = torch.ones(new, cached + new, dtype=torch.bool)
    for i, m in enumerate(masks):
        allowed[i, cached:] = torch.tensor([bool(m >> j & 1) for j in range(new)])
    if window is not None:
        k_pos = torch.cat([torch.arange(cached), torch.tensor(positions)])
        allowed &= k_pos[None, :] > torch.tensor(positions)[:, None] - window
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
