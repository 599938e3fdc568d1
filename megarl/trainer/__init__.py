"""megarl.trainer"""
