"""The rollout: drive an agent over a dataset through the capture proxy, one versioned step at a time.

Modules: `agents` (resolving and calling user agents), `data` (datasets and the deterministic step
schedule), `runner` (one run, inline or in a subprocess), `services` (the engine client and the
in-process proxy a stage runs beside its loop), `staleness` (weight-version gate and per-token
checks), `metrics` (per-step statistics), `loop` (the per-step loop), `external` (steps from
outside agents), `spool` (the standalone proxy's on-disk record of finished, unpublished sessions).
The rollout drives its proxy's sessions through `pipeline.proxy.control.ProxyControl`. docs/rollout.md.
"""
