"""The GPU suite: what a lent GPU machine runs (`python3 -m gpu.gpu_suite --call N --out $OUT`, docs/gpu.md),
apart from the experiments it runs there (`python -m experiments.<group>.<name>` subprocesses). `gpu_suite`
drives the phases (`gpu_phases`, `gpu_measure`), keeps their state outside the repository between device calls
(`gpu_state`), parses the scripts' output (`gpu_parse`), writes the report (`gpu_report`); `gpu_env` probes
the machine and `gpu_bundle` builds and assembles what the machine lacks (wheels, the model in two parts)."""
