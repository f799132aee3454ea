"""Offline analysis of run directories; nothing here runs during a run.

`inspect`, `step_views` and `viewer` (`arl inspect` and its HTML page), `diff`, `compare` and `divergence`
(`arl diff`), `replay` (`arl replay`), `query/` (`arl query`, DuckDB), `bench` (`arl bench`).
"""
