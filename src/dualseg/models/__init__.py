"""dualseg.models"""
