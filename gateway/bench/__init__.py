"""`hedge-gateway bench`: real processes on loopback, the same seeded workload in several
modes, and the report.

`run` orchestrates, `commands` runs the two commands, `load` is the streaming client, `procs`
starts and meters the child processes, `report` turns samples into tables, `judge` decides
which targets a run's sample can settle, and `upstream` is the child simulator
(`python -m gateway.bench.upstream`).

Nothing is imported here on purpose: `python -m gateway.bench.upstream` imports this package
first, and every simulator child would otherwise load the whole gateway (about 0.6 s of
start-up each) and import its own module a second time through `run`.
"""
