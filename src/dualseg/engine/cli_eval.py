"""Deprecated alias of :mod:`dualseg.commands.eval` (moved there; this module goes in 0.2)."""

from dualseg._deprecated import moved

main, __getattr__ = moved(__name__, "dualseg.commands.eval")
