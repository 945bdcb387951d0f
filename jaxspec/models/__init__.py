"""Trunks and draft heads: pure forward functions over params pytrees."""
