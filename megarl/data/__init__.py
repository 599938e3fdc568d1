"""megarl.data"""
