"""Critic engine: a GPTModel whose vocabulary output layer is replaced by a scalar value head.

On the last pipeline stage ``output_layer`` (a ColumnParallelLinear to V) becomes :class:`ValueHead`, a
``hidden -> 1`` linear replicated on every TP rank: one output cannot be split over TP, and the head is
tiny. Every TP rank sees the same full hidden state (megatron gathers sequence-parallel activations before
the output layer), so the replicas get identical gradients and stay identical; megatron's grad-norm
treats the head as a TP duplicate (no ``tensor_model_parallel`` attribute), and under sequence parallelism
the head is flagged like the layernorms so its gradient is all-reduced over TP. The head is initialised
from a fixed seed (the same on every rank and layout). The model must not tie embeddings and output.

``compute_values`` returns, per response token j, the value at the position that predicts it (P - 1 + j),
aligned with the actor's log-probs, on every rank of the replica. ``update_critic`` runs epochs x
mini-batches of the clipped value loss. Leaves out: a separate critic warmup schedule.
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.algorithms import compute_value_loss
from megarl.batch import TrainBatch
from megarl.engines.megatron.engine import MegatronEngine, average_metrics
from megarl.engines.megatron.row_outputs import whole_sequence
from megarl.engines.megatron.packing import response_positions_of, restore_row_order, scatter_to_rows

_HEAD_SEED = 20240601


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` projection with the ``output_layer`` call signature GPTModel uses."""

    def __init__(self, hidden_size: int, *, init_std: float, sequence_parallel: bool, dtype: torch.dtype,
                 bias: bool = True):
        super().__init__()
        generator = torch.Generator().manual_seed(_HEAD_SEED)
        self.weight = torch.nn.Parameter((torch.randn(1, hidden_size, generator=generator) * init_std).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel = sequence_parallel
        self.sequence_parallel = False  # GPTModel's inference path reads this attribute

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_head(module: torch.nn.Module, post_process: bool, *, bias: bool = True) -> None:
    """Replace the last stage's vocabulary projection with a :class:`ValueHead` (``bias=False``: a reward
    model's ``score`` projection, which has none)."""
    if not post_process:
        return
    config = module.config
    if getattr(module, "share_embeddings_and_output_weights", False):
        raise ValueError("a scalar-head model must be built with share_embeddings_and_output_weights=False")
    module.output_layer = ValueHead(
        config.hidden_size, init_std=config.init_method_std, sequence_parallel=config.sequence_parallel,
        dtype=config.params_dtype, bias=bias,
    )


class CriticEngine(MegatronEngine):
    """Constructor arguments are :class:`MegatronEngine`'s; ``model_provider`` builds a plain GPTModel."""

    def __init__(self, **kwargs):
        if "chunk_hook" in kwargs:
            raise TypeError("CriticEngine installs its own chunk_hook (the value head)")
        super().__init__(chunk_hook=attach_value_head, **kwargs)

    @staticmethod
    def _response_values(output: torch.Tensor, mb: dict) -> torch.Tensor:
        return scatter_to_rows(response_positions_of(whole_sequence(output, mb), mb)[..., 0].float(), mb)

    def compute_values(self, batch: TrainBatch, *, micro_batch_size: Optional[int] = None,
                       max_tokens: Optional[int] = None, replay_routing: bool = False) -> torch.Tensor:
        """Values ``[B, R]`` (fp32) for this DP shard, on every rank of the replica. ``replay_routing`` (MoE): the
        routers take ``batch.routed_experts``."""
        fields = self.routing_fields(batch, replay=replay_routing, compare=False)
        micro_batches = self.make_micro_batches(batch, fields, micro_batch_size=micro_batch_size,
                                                max_tokens=max_tokens)

        def loss(mb, output):
            return output.new_zeros(()), {"values": self._response_values(output, mb).detach()}

        with self.routing_pass(replay=replay_routing):
            reported = self.run_micro_batches(micro_batches, loss=loss, forward_only=True)
        values = restore_row_order([r["values"] for r in reported], micro_batches) if reported else None
        return self.broadcast_from_last_stage(values, tuple(batch.response_ids.shape))

    def update_critic(
        self, batch: TrainBatch, *, ppo_epochs: int = 1, mini_batch_size: Optional[int] = None,
        cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean", norm_length: Optional[int] = None,
        replay_routing: bool = False,
    ) -> dict[str, float]:
        """Clipped value loss against ``batch.returns`` with ``batch.values`` as the old values (``replay_routing``:
        as :meth:`compute_values`). Returns metrics averaged over the steps: vf_loss, vf_clipfrac, vpred_mean,
        grad_norm, lr."""
        for name in ("values", "returns"):
            if getattr(batch, name) is None:
                raise ValueError(f"update_critic: batch.{name} is required")
        norm_length = norm_length or batch.response_ids.shape[1]
        names = ["vf_loss", "vf_clipfrac_wsum", "vpred_mean_wsum"]

        def make_loss(num_tokens, num_seqs):
            def loss(mb, output):
                mask = mb["generated_mask"] if mb.get("generated_mask") is not None else mb["response_mask"]
                vf_loss, vf_metrics = compute_value_loss(
                    values=self._response_values(output, mb), old_values=mb["values"], returns=mb["returns"],
                    response_mask=mask, cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode,
                    global_num_tokens=num_tokens, global_num_seqs=num_seqs, norm_length=norm_length,
                )
                n_tok = mask.sum()
                return vf_loss, {
                    "vf_loss": vf_loss.detach(), "num_tokens": n_tok,
                    "vf_clipfrac_wsum": n_tok * vf_metrics["vf_clipfrac"],
                    "vpred_mean_wsum": n_tok * vf_metrics["vpred_mean"],
                }
            return loss

        routing_fields = self.routing_fields(batch, replay=replay_routing, compare=False)
        with self.routing_pass(replay=replay_routing):
            steps = self.train_epochs(
                batch, ppo_epochs=ppo_epochs, mini_batch_size=mini_batch_size,
                # multi-turn: values are fitted on the tokens the policy generated, not on tool results
                counted_mask=lambda mini: mini.policy_mask,
                fields=lambda mini: (("values", "returns") + routing_fields
                                     + (("generated_mask",) if mini.generated_mask is not None else ())),
                make_loss=make_loss, names=names)
        for step in steps:
            del step["num_tokens"]
        return average_metrics(steps)
