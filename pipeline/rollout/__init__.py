"""The rollout: drive an agent over a dataset through the capture proxy, one versioned step at a time.

Modules: `loop` (the per-step loop, `run_rollout`), `external` (the proxy stage, `run_external`: steps from
outside agents), `spool` (the standalone proxy's on-disk record of finished, unpublished sessions),
`staleness` (the weight-version gate and per-token checks), `stats` (per-step statistics), `tasks` (several
tasks' schedule and figures), `progress_bar`. One agent run, the datasets and the step schedule are in
`pipeline.agents`; the engine client and in-process proxy a stage runs beside its loop in
`pipeline.proxy.services`. The rollout drives its proxy's sessions through
`pipeline.proxy.control.ProxyControl`. docs/rollout.md.
"""
