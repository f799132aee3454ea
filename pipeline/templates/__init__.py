"""Jinja chat templates shipped with arl (read as package data by `pipeline.demo.tiny_model`)."""
