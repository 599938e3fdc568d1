"""megarl: Megatron-first RL post-training (PPO, GRPO and relatives) orchestrated by Ray."""

__version__ = "0.1.0"

from megarl import _import_guards

_import_guards.install()  # megatron-core without wandb, tensorboard's writer and torch's compiler stack at import
