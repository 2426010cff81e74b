"""The GPU suite: what a lent GPU machine runs (`python3 -m gpu.suite --call N --out $OUT`, docs/gpu.md),
apart from the experiments it runs there (`python -m experiments.<group>.<name>` subprocesses). `suite.py`
drives the phases (`phases.py`, `measure.py`, `regime_phases.py`, `rl_step_phases.py`; their order and
budgets: `call_plan.py`; their runner: `runner.py`), keeps their state outside the repository between device
calls (`state.py`), parses the scripts' output (`parse.py`), writes the report (`report.py`,
`markdown_tables.py`); `env.py` probes the machine and `bundle.py` builds and assembles what the machine
lacks (wheels, the model in two parts)."""
