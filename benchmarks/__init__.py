"""The benchmarks: scripts `arl bench` runs (pipeline/analysis/bench.py), and the helper modules they share.

A script (`proxy_load.py`) prints its figures and one `RESULT {json}` line; a helper (`_proxy_stack.py`,
a leading underscore) is imported, never run as a benchmark. Imports between them name the package,
`from benchmarks._proxy_stack import start_stack`, so a test imports the code a benchmark runs the same way
(`from benchmarks import proxy_load`). A script run by path (`python benchmarks/proxy_load.py`, as
`arl bench` does) first puts the repository root on `sys.path` for those imports to resolve.
"""
