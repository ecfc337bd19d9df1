"""`hedge-gateway bench` (SPEC §14): real processes on loopback, the same seeded workload in
several modes, and the report.

`run` orchestrates, `load` is the streaming client, `procs` starts and meters the child
processes, `report` turns samples into tables, and `upstream` is the child simulator
(`python -m gateway.bench.upstream`).
"""

from gateway.bench.commands import run_bench_command, run_soak_command
from gateway.bench.run import BenchPlan, run_bench

__all__ = ["BenchPlan", "run_bench", "run_bench_command", "run_soak_command"]
