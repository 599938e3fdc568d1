"""Streaming, memory-bounded checkpoint conversion between Hugging Face safetensors and the per-rank
megatron format of :mod:`megarl.models.mcore_checkpoint` (CLI wrappers live in ``converters/``)."""
