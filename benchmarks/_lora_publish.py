"""`benchmarks/lora.py`'s publication group: one LoRA version published to a real `hf` engine, merged vs adapter.

Both by the trainer's own code: `lora.save_checkpoint` (the adapter alone, or with `merged/`) and the trainer's
`Publisher` with verification on (disk sync; `publish: adapter` loads the adapter by `/load_lora_adapter`,
`publish: merged` reloads the whole model by `/update_weights_from_disk`), against one server serving the
benchmark's model. The adapter version is published first: a merged publication changes the server's base.
The merge itself is not timed here (`lora.py` times it): both modes hand the publisher the merged weights,
which the verifier's reference needs.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any


def publication_figures(model_dir: Path, workdir: Path, rank: int = 16) -> dict[str, float]:
    """Seconds to write the checkpoint and to publish it (send, verify), and its bytes, per mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.engine.registry import write_entry
    from pipeline.engine.server.hf.process import start_hf_server
    from pipeline.run.paths import RunPaths
    from pipeline.trainer import lora
    from pipeline.trainer.publish.publisher import Publisher, PublishOptions
    from schemas.config import LoraConfig
    from schemas.engine_api import InferenceEntry

    base: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    wrapped = lora.wrap(base, LoraConfig(rank=rank, alpha=2 * rank), None)
    with torch.no_grad():  # a trained adapter: B away from PEFT's zero start
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    adapter, config = lora.adapter_weights(wrapped), lora.adapter_config(wrapped, model_dir)
    merged = lora.merged_weights(wrapped.state_dict(), lora.scaling(wrapped))
    del wrapped, base
    paths = RunPaths(workdir / "publish-run")
    figures: dict[str, float] = {}
    with start_hf_server(model_dir, seed=0) as server:
        write_entry(paths, "s0", InferenceEntry(url=server.url, backend="hf", model_path=str(model_dir),
                                                weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                                started_at=time.time()))  # fmt: skip
        for version, mode in ((1, "adapter"), (2, "merged")):
            start = time.perf_counter()
            written = lora.AdapterCheckpoint(adapter, config, merged if mode == "merged" else None)
            lora.save_checkpoint(paths, version, written, model_dir, None, "float32")
            figures[f"{mode} checkpoint write s"] = time.perf_counter() - start
            options = PublishOptions(verify_model=model_dir, adapter=mode == "adapter")
            publisher = Publisher("disk", paths, 600.0, tied, options)
            try:
                start = time.perf_counter()
                report = publisher.publish(version, paths.weights_dir(version), merged)
                figures[f"{mode} publish s"] = time.perf_counter() - start
            finally:
                publisher.close()
            if report.servers != [server.url]:
                raise RuntimeError(f"version {version} ({mode}) was not verified: {report.reasons}")
            figures[f"{mode} send s"], figures[f"{mode} verify s"] = report.sync_s, report.verify_s
            figures[f"{mode} bytes sent"] = float(_bytes(paths.weights_dir(version)))
    return figures


def _bytes(path: Path) -> int:
    """What the server reads: the adapter's files, or the merged model's."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))
