"""The trainer: GRPO/PPO on a step of trajectory shards, checkpoints, weight publication.

Backend-independent pieces (advantages, losses, packing, schedule, checkpoints, publication) are
shared by every backend; a backend (`backend.py`) only runs forward/backward passes and owns the
model and optimizer. See docs/trainer.md.
"""
