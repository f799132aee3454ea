"""The run's shared contracts: what every stage and tool reads (docs/run-directory.md).

`paths` (every path of the run dir), `config` (load, override, freeze), `handoff` (atomic publication and
waits with deadlines), `stage` (the `StageContext` every stage starts with), `shards` (a step's Parquet parts
and manifest), `weight_version` (the announced version), `jobs` and `job_state` (`jobs.json` and the live
state of recorded jobs), `logs` (process set-up), `sinks` (metrics sinks), `progress`, `timeline` and
`console` (what people watch). Nothing here imports another arl folder but `pipeline.errors`.
"""
