"""Evaluation: a checkpoint's agents on held-out sets, scored (`arl eval`, docs/evaluation.md)."""
