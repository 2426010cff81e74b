"""The experiment scripts, by kind: `paper/` (reproductions of paper results), `bench/` (micro-benchmarks),
`models/` (models and projections), `checks/` (properties checked on this machine) and `lib/` (what they
share). Each runs from the repository root as `python -m experiments.<group>.<name>`; its `--help` says what
it measures, and experiments/README.md maps the paper's tables and figures to the scripts."""
