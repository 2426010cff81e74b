"""Reproductions of the TLT paper's results (experiments/README.md maps each to its table or figure)."""
