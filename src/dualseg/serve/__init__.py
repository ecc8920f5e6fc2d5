"""dualseg.serve"""
