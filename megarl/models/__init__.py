"""megarl.models"""
