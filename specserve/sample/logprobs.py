"""Log-probability entries of chosen tokens: the sampled tokens' (``SamplingParams.logprobs``)
and the prompt's (``prompt_logprobs``), both of the target's raw distribution."""
from __future__ import annotations

import torch

from specserve.outputs import Logprob, logprob_entries


def logprob_rows(tokenizer, logits: torch.Tensor, chosen: list[int], n_top: int) -> list[dict[int, Logprob]]:
    """Row i of ``logits`` [R, V] (raw, float32) -> {token id: Logprob}: ``chosen[i]``'s
    log-probability and the ``n_top`` most likely tokens' (0: the chosen token's alone)."""
    lps = torch.log_softmax(logits, dim=-1)                                   # [R, V]
    picked = lps.gather(1, torch.tensor(chosen, device=lps.device).unsqueeze(1)).squeeze(1).tolist()
    top_lps, top_ids = lps.topk(max(n_top, 1), dim=-1) if n_top else (lps[:, :0], lps[:, :0].long())
    return [logprob_entries(tokenizer, tok, picked[i], top_ids[i].tolist(), top_lps[i].tolist())
            for i, tok in enumerate(chosen)]
