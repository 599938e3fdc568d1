"""Checkpoint and conversion I/O: atomic files and the tracker every writer uses (:mod:`.files`), Hugging Face
safetensors read and indexed (:mod:`.safetensors_stream`, :mod:`.hf_index`, FP8 blocks :mod:`.fp8`), megatron's
torch_dist format (:mod:`.torch_dist_layout`, :mod:`.torch_dist_writer`, :mod:`.torch_dist_reader`), and the
streaming, resumable converters between them (:mod:`.hf_to_mcore`, :mod:`.mcore_to_hf`, run by the worker
pool of :mod:`.execution` within :mod:`.memory`'s budget). The command lines are ``converters/``."""
