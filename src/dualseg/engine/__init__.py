"""dualseg.engine"""
