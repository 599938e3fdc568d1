"""megarl: Megatron-first RL post-training (PPO, GRPO and relatives) orchestrated by Ray."""

__version__ = "0.1.0"
