"""Mutation checks: deliberate bugs that named tests must catch (see test_mutations.py)."""
