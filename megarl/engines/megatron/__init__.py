"""megarl.engines.megatron"""
