"""What a reward model reads: the policy's samples, in the reward model's own tokens.

When the reward model's tokenizer has the policy's vocabulary, its inputs are the policy's token ids as they
are. Otherwise (or when ``reward_model.model.input_tokenizer`` is set, verl's switch) each sample becomes text
and is tokenized again: the dataset's prompt (its chat messages, or its text) plus the response decoded with
the policy's tokenizer (special tokens dropped) are rendered with the reward model's chat template as a user
turn and an assistant turn; a tokenizer without a chat template gets the prompt's text, a newline and the
response. The tokens up to the end of the rendered prompt (with its assistant header) are the reward model's
prompt, the rest its response; the score is read at the last token either way.

``max_length`` caps each input: a longer one loses tokens from its start (the end, where the score is read,
is kept), counted in ``reward/rm/truncated``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.batch import RolloutBatch, TrainBatch


def same_vocabulary(policy_tokenizer, rm_tokenizer) -> bool:
    return policy_tokenizer is rm_tokenizer or policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab()


def prompt_messages(raw_prompt: Any) -> list[dict]:
    """The dataset's prompt as chat messages (a plain string is one user message)."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in raw_prompt]


class RewardModelInputs:
    """Builds the reward model's batch from a rollout batch (see the module docstring)."""

    def __init__(self, policy_tokenizer, rm_tokenizer, *, max_length: Optional[int] = None,
                 retokenize: Optional[bool] = None):
        self.policy_tokenizer = policy_tokenizer
        self.rm_tokenizer = rm_tokenizer
        self.max_length = max_length
        self.retokenize = (not same_vocabulary(policy_tokenizer, rm_tokenizer)) if retokenize is None else retokenize
        self.pad_token_id = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else 0

    def build(self, batch: RolloutBatch) -> tuple[TrainBatch, dict[str, float]]:
        if self.retokenize:
            pairs = [self._retokenized(batch, row) for row in range(len(batch))]
        else:
            pairs = [(ids[mask.bool()].tolist(), resp[rmask.bool()].tolist()) for ids, mask, resp, rmask in
                     zip(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)]
        truncated = 0
        if self.max_length is not None:
            capped = []
            for prompt, response in pairs:
                excess = len(prompt) + len(response) - self.max_length
                if excess > 0:
                    truncated += 1
                    kept = (prompt + response)[excess:]
                    # the split only places the tokens (the score is read at the last one); a row needs a prompt
                    split = max(len(prompt) - excess, 1)
                    prompt, response = kept[:split], kept[split:]
                capped.append((prompt, response))
            pairs = capped
        return self._padded(pairs, batch.group_ids), {"reward/rm/truncated": float(truncated),
                                                      "reward/rm/retokenized": float(self.retokenize)}

    def _retokenized(self, batch: RolloutBatch, row: int) -> tuple[list[int], list[int]]:
        policy = self.policy_tokenizer
        response = policy.decode(batch.response_ids[row][batch.response_mask[row].bool()].tolist(),
                                 skip_special_tokens=True)
        if batch.raw_prompts:
            messages = prompt_messages(batch.raw_prompts[row])
        else:  # no dataset prompt at hand: the policy's prompt tokens as text
            text = policy.decode(batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist(), skip_special_tokens=True)
            messages = [{"role": "user", "content": text}]
        rm = self.rm_tokenizer
        if getattr(rm, "chat_template", None):
            prompt_text = rm.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            full_text = rm.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        else:
            prompt_text = "\n".join(m["content"] for m in messages) + "\n"
            full_text = prompt_text + response
        prompt_ids = rm.encode(prompt_text, add_special_tokens=False)
        full_ids = rm.encode(full_text, add_special_tokens=False)
        shared = 0  # the rendered prompt is a prefix of the whole text; its tokens normally are too
        while shared < min(len(prompt_ids), len(full_ids)) and prompt_ids[shared] == full_ids[shared]:
            shared += 1
        shared = max(shared, 1)
        return full_ids[:shared], full_ids[shared:]

    def _padded(self, pairs: list[tuple[list[int], list[int]]], group_ids: list[str]) -> TrainBatch:
        rows = len(pairs)
        width_p = max(1, max(len(p) for p, _ in pairs))
        width_r = max(1, max(len(r) for _, r in pairs))
        prompt_ids = torch.full((rows, width_p), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
        response_ids = torch.full((rows, width_r), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, width_r), dtype=torch.long)
        for row, (prompt, response) in enumerate(pairs):
            if not prompt:
                raise ValueError(f"reward model input {row} has no prompt token")
            prompt_ids[row, width_p - len(prompt):] = torch.as_tensor(prompt)
            prompt_mask[row, width_p - len(prompt):] = 1
            if response:
                response_ids[row, :len(response)] = torch.as_tensor(response)
                response_mask[row, :len(response)] = 1
        return TrainBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                          response_mask=response_mask, group_ids=list(group_ids))


def combine_scores(*, rm_scores: Optional[torch.Tensor], function_scores: Optional[torch.Tensor],
                   judge_scores: Optional[torch.Tensor], rm_weight: float, function_weight: float,
                   judge_weight: float, normalize: bool, clip: Optional[float]) -> tuple[torch.Tensor, dict]:
    """The combined sequence score and per-source metrics. RM scores are whitened over the batch (when
    ``normalize``) and then clamped to ``[-clip, clip]`` (when given) before they are weighted."""
    metrics: dict[str, float] = {}
    total = None

    def add(part: torch.Tensor, weight: float):
        nonlocal total
        total = weight * part if total is None else total + weight * part

    if rm_scores is not None:
        rm = rm_scores.float()
        metrics.update({"reward/rm/raw_mean": float(rm.mean()), "reward/rm/raw_max": float(rm.max()),
                        "reward/rm/raw_min": float(rm.min())})
        if normalize:
            rm = (rm - rm.mean()) / (rm.std(unbiased=False) + 1e-6) if len(rm) > 1 else rm - rm.mean()
        if clip is not None:
            metrics["reward/rm/clip_fraction"] = float((rm.abs() > clip).float().mean())
            rm = rm.clamp(-clip, clip)
        metrics["reward/rm/mean"] = float(rm.mean())
        add(rm, rm_weight)
    if function_scores is not None:
        metrics["reward/function/mean"] = float(function_scores.float().mean())
        add(function_scores.float(), function_weight)
    if judge_scores is not None:
        metrics["reward/judge/mean"] = float(judge_scores.float().mean())
        add(judge_scores.float(), judge_weight)
    if total is None:
        raise ValueError("no reward source is on")
    return total, metrics
