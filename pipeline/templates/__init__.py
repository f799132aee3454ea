"""Jinja chat templates shipped with arl (read as package data by `pipeline.tiny_model`)."""
