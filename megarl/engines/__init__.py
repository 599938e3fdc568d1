"""megarl.engines"""
