"""What is on a rank's device while the Megatron actor, its reference and a colocated rollout engine take
turns with it (the hybrid engine), with one named call per phase change:

* :meth:`DeviceResidency.for_generation`: the engines' offloaded parts (per ``megatron.*_offload`` and
  ``ref.param_offload``) leave the device, the rollout engine wakes (weights and KV cache);
* :meth:`DeviceResidency.for_training`: the rollout engine sleeps (where it supports sleep and
  ``rollout.free_cache_engine`` asks for it; level 2 when a weight sync follows, so its weights are dropped,
  not copied to the host), the engines come back;
* :meth:`DeviceResidency.for_weight_sync`: the actor's parameters are back (the gather reads them) and the
  rollout engine holds its weights to be written into, its KV cache still freed.

Each call is a no-op for what is already where it should be, so the worker methods may call the phase they
need without knowing which came before. A colocated worker makes room before it starts its rollout engine
(:meth:`DeviceResidency.make_room_for_rollout`, then :meth:`DeviceResidency.attach_rollout`): vLLM sizes its
share of the device from the memory free at its start, and at 7B the trainer's state would not leave it any.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadPolicy:
    actor_params: bool = False
    actor_grads: bool = False
    actor_optimizer: bool = False
    reference_params: bool = False

    @property
    def offloads_actor(self) -> bool:
        return self.actor_params or self.actor_grads or self.actor_optimizer


class DeviceResidency:
    def __init__(self, *, actor, reference=None, offload: OffloadPolicy = OffloadPolicy()):
        """Without a rollout engine (separate placement) until :meth:`attach_rollout`."""
        self.actor, self.reference, self.rollout = actor, reference, None
        self.offload = offload
        self.rollout_sleeps = False
        self._actor_offloaded = None  # OffloadState while generation owns the device
        self._reference_offloaded = None
        self._rollout_asleep = False
        self.rollout_keeps_weights = False

    def attach_rollout(self, rollout, *, rollout_sleeps: bool = True, keeps_weights: bool = False) -> None:
        """The rollout engine, started after :meth:`make_room_for_rollout`; until the first phase call the
        device stays as generation wants it. ``keeps_weights``: a weight sync does not bring the whole model
        (a served LoRA adapter), so sleeping never drops the engine's weights."""
        self.rollout = rollout
        self.rollout_sleeps = rollout_sleeps and rollout.supports_sleep
        self.rollout_keeps_weights = keeps_weights

    def for_generation(self) -> None:
        if self.rollout is None:  # generation runs elsewhere (separate placement): nothing here makes room for it
            return
        self.make_room_for_rollout()
        if self._rollout_asleep:
            self.rollout.wake_up()
            self._rollout_asleep = False

    def make_room_for_rollout(self) -> None:
        """The offloaded parts of the actor and reference (per the policy) leave the device."""
        from megarl.engines.megatron.offload import offload_engine

        p = self.offload
        if self._actor_offloaded is None and p.offloads_actor:
            self._actor_offloaded = offload_engine(self.actor, params=p.actor_params, grads=p.actor_grads,
                                                   optimizer=p.actor_optimizer)
        if self.reference is not None and self._reference_offloaded is None and p.reference_params:
            self._reference_offloaded = offload_engine(self.reference, params=True, grads=False, optimizer=False)

    def for_training(self, *, weight_sync_follows: bool) -> None:
        """``weight_sync_follows``: the rollout weights will be overwritten before the next generation (the
        step's update phases), so the engine may drop them instead of saving them to host memory."""
        if self.rollout_sleeps and not self._rollout_asleep:
            self.rollout.sleep(discard_weights=weight_sync_follows and not self.rollout_keeps_weights)
            self._rollout_asleep = True
        self._reload_actor()
        if self._reference_offloaded is not None:
            self._reload(self._reference_offloaded)
            self._reference_offloaded = None

    def for_weight_sync(self) -> None:
        self._reload_actor()
        if self._rollout_asleep:  # the engine must hold its weights to be written into; the KV cache can wait
            self.rollout.wake_up(weights_only=True)

    def _reload_actor(self) -> None:
        if self._actor_offloaded is not None:
            self._reload(self._actor_offloaded)
            self._actor_offloaded = None

    @staticmethod
    def _reload(state) -> None:
        from megarl.engines.megatron.offload import reload_engine

        reload_engine(state)
