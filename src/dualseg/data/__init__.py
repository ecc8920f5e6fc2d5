"""dualseg.data"""
