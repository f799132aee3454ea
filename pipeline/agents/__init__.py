"""The agent side of a session, shared by the rollout, evaluation and the pre-launch checks.

`loading` (how the config names an agent and what it must look like), `runner` (one agent run, inline or
in a worker process), `episode` (one agent run as a proxy session: admitted, run, rewarded, ended),
`dataset` (prompt data and the deterministic step schedule), `outcome` (what an agent's return value means,
shared with `pipeline.client`).
"""
