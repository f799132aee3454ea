"""HF-layout checkpoints, the trainer state that goes with them, resume points and pruning.

Layout (docs/run-directory.md): `checkpoints/step_%06d/` holds weight VERSION v (config.json,
generation_config.json, model.safetensors or sharded *.safetensors + index, tokenizer files,
`_COMPLETE`), loadable with plain `AutoModelForCausalLM.from_pretrained`. `state/trainer/step_%06d/`
holds what exact resume needs beyond the weights: optimizer and scheduler state (written by the
backend), RNG states (torch, numpy, python, CUDA) and `data.json` (next step, seed, world size),
with its own `_COMPLETE`.

Crash safety: both directories are staged under a temp name and renamed into place with the marker
written last (`pipeline.run.handoff`); the state is published BEFORE the checkpoint, so "checkpoint v is
complete" implies "state v is complete", and a resume point is a version with both. `LATEST` is
rewritten after every checkpoint; old versions are deleted only after a newer one is complete.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.run.handoff import (
    clean_stale_tmp,
    naming_write_errors,
    publish_dir,
    remove_published,
    staging_dir,
    write_text_atomic,
)
from pipeline.run.paths import COMPLETE, RunPaths

log = logging.getLogger("arl.trainer")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_SHARD_BYTES = 5 * 1024**3
RNG_FILE = "rng.pkl"
DATA_FILE = "data.json"


def save_checkpoint(
    paths: RunPaths,
    version: int,
    state_dict: dict[str, torch.Tensor],
    model_dir: Path,
    tokenizer_dir: Path | None = None,
    dtype: str | None = None,
) -> Path:
    """Publish weight `version` atomically in HF layout and point `LATEST` at the newest complete one."""
    return publish_checkpoint(
        paths, version, lambda staged: write_hf_model(staged, state_dict, model_dir, tokenizer_dir, dtype)
    )


def publish_checkpoint(paths: RunPaths, version: int, fill: Callable[[Path], None]) -> Path:
    """Publish checkpoint `version` atomically, its files written by `fill(staging dir)` (full weights, or a LoRA
    adapter), and point `LATEST` at the newest complete one."""
    final = paths.checkpoint_dir(version)
    with staging_dir(final) as staged:
        fill(staged)
        publish_dir(staged, final, COMPLETE, {"version": version, "created_at": time.time()})
    write_text_atomic(paths.latest, f"{max(paths.complete_checkpoints())}\n")
    return final


def write_hf_model(
    out_dir: Path,
    state_dict: dict[str, torch.Tensor],
    model_dir: Path,
    tokenizer_dir: Path | None = None,
    dtype: str | None = None,
) -> None:
    """A Hugging Face model directory in `out_dir` (existing, empty): the initial model's config files with
    `state_dict`'s weights (a tied output layer stored once) and the tokenizer of `tokenizer_dir` or the model."""
    _copy_model_files(model_dir, out_dir)
    if tokenizer_dir is not None and tokenizer_dir.resolve() != model_dir.resolve():
        copy_tokenizer(tokenizer_dir, out_dir)
    if dtype is not None:
        _set_config_dtype(out_dir / "config.json", dtype)
    write_safetensors(out_dir, _drop_tied(state_dict, out_dir / "config.json"))


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files and chat template of `src` into `dst`."""
    _copy_model_files(src, dst, only_tokenizer=True)


def buckets(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a bigger tensor travels alone):
    checkpoint shards and broadcast buckets alike."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > max_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += nbytes
    return [b for b in out if b]


def write_safetensors(out_dir: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """`model.safetensors`, or shards of <= 5 GiB plus `model.safetensors.index.json` (the HF convention)."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    shards = buckets(tensors, MAX_SHARD_BYTES) or [{}]
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_model_files(src: Path, dst: Path, only_tokenizer: bool = False) -> None:
    """Config, generation config and tokenizer files of the initial model (they never change in training)."""
    for item in src.iterdir():
        if not item.is_file() or item.name.endswith(WEIGHT_SUFFIXES) or item.name in WEIGHT_INDEXES:
            continue
        if item.name.startswith(".") or item.name == COMPLETE:
            continue
        if only_tokenizer and not (
            item.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or item.name.endswith(".jinja")
        ):
            continue
        shutil.copy2(item, dst / item.name)


def _set_config_dtype(config_path: Path, dtype: str) -> None:
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _drop_tied(state_dict: dict[str, torch.Tensor], config_path: Path) -> dict[str, torch.Tensor]:
    """With tied embeddings the output layer is the embedding: store it once (safetensors refuses aliases)."""
    tied = json.loads(config_path.read_text()).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" in state_dict:
        return {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    return state_dict


# -- trainer state ---------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_torch(obj: Any, path: Path) -> None:
    """`torch.save` whose failures name the file and the cause: the zip writer turns a full disk into
    "unexpected pos N vs M"; the legacy stream format surfaces the OS error text (still loads with torch.load)."""
    with naming_write_errors(path), open(path, "wb") as handle:
        torch.save(obj, handle, _use_new_zipfile_serialization=False)


def stage_trainer_state(paths: RunPaths, version: int) -> Path:
    """A fresh staging dir for state `version` (rank 0 only; the backend writes into it, then `publish_state`)."""
    final = paths.trainer_state_dir(version)
    final.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(final) as staged:
        return staged


def publish_state(paths: RunPaths, version: int, staged: Path, data: dict[str, Any]) -> Path:
    """Add RNG and data state to a staged state dir and publish it with its marker."""
    with naming_write_errors(staged):
        (staged / RNG_FILE).write_bytes(pickle.dumps(rng_state()))
        (staged / DATA_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return publish_dir(staged, paths.trainer_state_dir(version), COMPLETE, {"version": version})


def load_rng(state_dir: Path) -> None:
    set_rng_state(pickle.loads((state_dir / RNG_FILE).read_bytes()))


def state_complete(paths: RunPaths, version: int) -> bool:
    return (paths.trainer_state_dir(version) / COMPLETE).exists()


def resume_point(paths: RunPaths) -> int:
    """Newest version with a complete checkpoint AND complete trainer state; 0 (the initial model) if none."""
    versions = [v for v in paths.complete_checkpoints() if state_complete(paths, v)]
    return max(versions, default=0)


def clean_partial(paths: RunPaths) -> None:
    """Remove leftovers of a writer killed mid-publish (staging dirs are `*.tmp`)."""
    for removed in clean_stale_tmp(paths.checkpoints) + clean_stale_tmp(paths.state / "trainer"):
        log.info("removed partial %s left by an interrupted trainer", removed)


def prune(paths: RunPaths, keep: int, newest: int) -> list[int]:
    """Delete complete checkpoints (and their state) older than the `keep` newest; never `newest` itself."""
    complete = paths.complete_checkpoints()
    doomed = [v for v in complete[:-keep] if v != newest] if len(complete) > keep else []
    for v in doomed:
        remove_published(paths.checkpoint_dir(v))
        remove_published(paths.trainer_state_dir(v))
    if doomed:
        log.info("pruned checkpoints %s (keep_checkpoints=%d)", doomed, keep)
    return doomed
