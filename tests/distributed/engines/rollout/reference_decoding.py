"""Independent reference computations for rollout tests: full-recompute greedy decoding and scoring.

No KV cache, no padding, no batching: one prompt at a time through a plain HF forward, so a bug in the
engines' cached/padded loops cannot hide in the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def greedy_decode(model, prompt: list[int], max_tokens: int, eos_ids: set[int]) -> list[int]:
    ids = list(prompt)
    response: list[int] = []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        token = int(torch.argmax(logits))
        response.append(token)
        ids.append(token)
        if token in eos_ids:
            break
    return response


@torch.no_grad()
def score_response(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / temperature) of each response token, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    log_probs = F.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()
