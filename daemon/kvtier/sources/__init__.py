"""Hotness sources: DAMON, page access bits, perf samples (see base.py)."""
