"""Tests of instride.parallel (split-apply-combine analysis)."""
