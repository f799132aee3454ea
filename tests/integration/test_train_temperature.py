"""The trainer's log-probs are of the distribution that sampled: engines report log softmax(logits / T)
at the request's temperature, so with `rollout.temperature = T` the trainer must match them; at the
wrong temperature the PPO ratio would be off before any update."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from pipeline.engine.server.hf.process import start_hf_server
from pipeline.run.config import load_config
from pipeline.trainer.data import Sample
from pipeline.trainer.packing import build_micro_batch
from pipeline.trainer.torch_backend import TorchBackend


def _sampled(url: str, prompt: list[int], temperature: float) -> tuple[list[int], list[float]]:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": temperature, "ignore_eos": True}}  # fmt: skip
    reply = httpx.post(url + "/generate", json=body, timeout=60).json()
    pairs = reply["meta_info"]["output_token_logprobs"]
    return [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_trainer_logprobs_match_engine_at_the_rollout_temperature(tiny_model_dir: Path, temperature: float) -> None:
    server = start_hf_server(tiny_model_dir)
    try:
        prompt = [11, 42, 7, 99, 3]
        output, engine_logp = _sampled(server.url, prompt, temperature)
    finally:
        server.stop()
    ids = np.array(prompt + output)
    mask = np.array([0] * len(prompt) + [1] * len(output), dtype=np.int8)
    logprobs = np.array([0.0] * len(prompt) + engine_logp, dtype=np.float32)
    sample = Sample("s", "g", ids, mask, logprobs, np.where(mask == 1, 0, -1), 1.0)
    micro = build_micro_batch([sample], [0], np.zeros(1), {0: 1.0})
    for temp, should_match in ((temperature, True), (1.0, False)):
        config = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=cpu",
                                    f"rollout.temperature={temp}"])  # fmt: skip
        backend = TorchBackend(config, total_updates=1)
        try:
            backend.load(tiny_model_dir, None)
            trainer_logp = backend.logprobs(micro)[micro.tokens.mask.bool()]
        finally:
            backend.close()
        close = torch.allclose(trainer_logp, torch.tensor(engine_logp), atol=1e-4)
        assert close == should_match, (temp, trainer_logp, engine_logp)
