"""dualseg.export"""
