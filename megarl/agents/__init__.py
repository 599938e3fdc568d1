"""Pieces of multi-turn, tool-calling rollouts: tool-call parsing, tools and their limits (pure Python; no
engines). The agent loop that drives a rollout engine through turns builds on these."""
