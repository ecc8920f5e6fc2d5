"""dualseg.refine"""
