"""The experiment scripts: benchmarks and studies of tlt_jax, each run from the repository root as
`python -m experiments.<name>` (its `--help` says what it measures; `harness.py` holds what they share)."""
