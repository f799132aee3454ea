"""The inference stage (`arl stage inference`): this node's servers, started, registered and supervised.

`servers` (the stage's entry point, `run_inference`), `procs` (one server's processes, per backend),
`placement` (which node and GPUs each server gets), `supervise` (health, crashes, take-out requests,
recovery), `orphans` (registry entries of ended attempts).
"""
