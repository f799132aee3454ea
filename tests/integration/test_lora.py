"""LoRA training (`trainer.lora`) with real PEFT on the tiny model: only the adapter trains, the KL reference is
the base, checkpoints are PEFT's own format (plain `PeftModel.from_pretrained` loads them), `arl export-merged`
and merged publication to a real `hf` engine serve exactly base + adapter, resume is bitwise, and FSDP2 across
two gloo processes trains the same adapter as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp import train_single_and_sharded  # tests/integration is on sys.path (pytest)
from test_publish import PROMPT, engine_logprobs, register
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.engine.server.hf.process import start_hf_server
from pipeline.run.handoff import read_json
from pipeline.run.paths import RunPaths
from pipeline.run.stage import StageContext
from pipeline.trainer.advantages import compute_advantages
from pipeline.trainer.loop import Trainer, run_trainer
from pipeline.trainer.losses import gather_logprobs
from pipeline.trainer.metrics import Timings

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.optimizer.lr=0.01", "rollout.max_staleness=10",
        "trainer.wait_timeout_s=30", "trainer.publish_timeout_s=120"]  # fmt: skip
NORMS = "trainer.lora.modules_to_save=[norm]"
"""Every norm of the tiny model (each module whose name ends in `norm`) trained in full beside the adapters."""
REPO = Path(__file__).resolve().parents[2]


def peft_model(base: Path, adapter: Path) -> torch.nn.Module:
    """Base + adapter the way a user without arl loads them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).eval()


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Log-probabilities of each next token of `ids` (teacher forced)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_a_step_trains_only_the_adapter_and_the_reference_is_the_base(make_train_run, tiny_model_dir: Path) -> None:
    paths = make_train_run(steps=[0], overrides=[*LORA, NORMS, "num_steps=1", "trainer.algorithm.kl_coef=0.1"])
    trainer = Trainer(StageContext.from_run_dir("train", paths.root).config, paths)
    try:
        trainer.start_from(0)
        data = trainer.wait_and_load(0, Timings())
        advantages = compute_advantages([s.reward for s in data.samples], [s.group_id for s in data.samples], "grpo")
        plan = trainer.plan(data, advantages, 0)
        model = trainer.backend.model  # type: ignore[attr-defined]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        adapters = {n for n, p in model.named_parameters() if p.requires_grad}
        norms = {n for n in adapters if ".modules_to_save." in n}
        assert len(norms) == sum(name.endswith("norm") for name, _ in hf_model(tiny_model_dir).named_modules()) > 0
        assert all(".lora_" in n for n in adapters - norms)
        trainer.update(plan, Timings())
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert changed == {n for n in adapters if ".lora_B." in n} | norms  # B starts at 0: A's first gradient is 0
        trainer.update(plan, Timings())
        assert {n for n, p in model.named_parameters() if not torch.equal(p, before[n])} == adapters
        optimized = {id(p) for group in trainer.backend.optimizer.param_groups for p in group["params"]}  # type: ignore[attr-defined]
        assert optimized == {id(p) for p in model.parameters() if p.requires_grad}

        micro = plan[0][0]
        base = hf_model(tiny_model_dir)
        with torch.no_grad():
            out = base(input_ids=micro.input_ids, position_ids=micro.position_ids).logits
        expected = gather_logprobs(out.reshape(-1, out.shape[-1]), micro.targets)
        reference = trainer.backend.logprobs(micro, reference=True)
        assert max_diff(reference, expected) < 1e-6  # adapters (and trained norms) disabled = the base, no copy
        assert max_diff(trainer.backend.logprobs(micro), expected) > 1e-4  # while the policy has moved
        assert getattr(trainer.backend, "reference", None) is None
    finally:
        trainer.close()


def test_only_norms_train_in_full(tiny_model_dir: Path) -> None:
    from pipeline.errors import ConfigError
    from pipeline.trainer.lora import wrap
    from schemas.config.trainer import LoraConfig

    with pytest.raises(ConfigError, match=r"modules_to_save trains model\.embed_tokens \(Embedding\).*only normal"):
        wrap(hf_model(tiny_model_dir), LoraConfig(modules_to_save=["embed_tokens"]), None)


def test_checkpoint_is_peft_format_and_merged_publication_serves_base_plus_adapter(
    make_train_run, tiny_model_dir: Path, tmp_path: Path
) -> None:
    paths = make_train_run(steps=[0], overrides=[*LORA, NORMS, "num_steps=1", "trainer.weight_sync=disk"])
    with start_hf_server(tiny_model_dir, seed=0) as server:
        register(paths, "s0", server.url, tiny_model_dir)
        run_trainer(StageContext.from_run_dir("train", paths.root))  # publishes with verification on
        ids, _, version = engine_logprobs(server.url)
        served = torch.tensor(served_prompt_logprobs(server.url, PROMPT + ids))
    assert version == 1 and read_json(paths.weight_version)["checkpoint"] == "checkpoints/step_000001/merged"

    ckpt = paths.checkpoint_dir(1)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in ckpt.iterdir()}
    assert Path(read_json(ckpt / "adapter_config.json")["base_model_name_or_path"]) == tiny_model_dir.resolve()
    assert not (ckpt / "model.safetensors").exists()
    probe = PROMPT + ids
    expected = probe_logprobs(peft_model(tiny_model_dir, ckpt), probe)  # plain PEFT, no arl code
    assert max_diff(served, expected) < 1e-5
    assert max_diff(probe_logprobs(hf_model(ckpt / "merged"), probe), expected) < 1e-5
    assert max_diff(probe_logprobs(hf_model(tiny_model_dir), probe), expected) > 1e-3  # the adapter did something

    # merged/ keeps every weight the adapters do not touch bit for bit, and takes the trained norms as saved
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    merged = load_file(str(ckpt / "merged" / "model.safetensors"))
    adapter = load_file(str(ckpt / "adapter_model.safetensors"))
    norms = [k for k in initial if k.endswith("norm.weight")]
    assert norms and all(torch.equal(merged[k], adapter[f"base_model.model.{k}"]) for k in norms)
    assert not any(torch.equal(merged[k], initial[k]) for k in norms)
    untouched = [k for k in initial if not k.endswith(("proj.weight", "norm.weight"))]
    assert untouched and all(torch.equal(initial[k], merged[k]) for k in untouched)

    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export-merged", str(paths.root), str(out), "--step", "1"])
    assert result.exit_code == 0, result.output
    assert max_diff(probe_logprobs(hf_model(out), probe), expected) < 1e-5
    again = CliRunner().invoke(app, ["export-merged", str(paths.root), str(out), "--step", "1"])
    assert again.exit_code == 2 and "exists" in again.output
    missing = CliRunner().invoke(app, ["export-merged", str(paths.root), str(tmp_path / "x"), "--step", "7"])
    assert missing.exit_code == 2 and "no complete checkpoint of version 7" in missing.output


@pytest.mark.slow
def test_merged_publication_by_broadcast_serves_base_plus_adapter(make_train_run, tiny_model_dir: Path) -> None:
    """`trainer.weight_sync: nccl` (gloo on CPU) broadcasts the merged tensors of a LoRA run from the trainer's own
    process, as `arl launch` runs it."""
    import subprocess
    import sys

    paths = make_train_run(steps=[0], overrides=[*LORA, "num_steps=1", "trainer.weight_sync=nccl"])
    with start_hf_server(tiny_model_dir, seed=0) as server:
        register(paths, "s0", server.url, tiny_model_dir)
        cmd = [sys.executable, "-m", "pipeline.cli", "stage", "train", "--run-dir", str(paths.root)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids, _, version = engine_logprobs(server.url)
        served = torch.tensor(served_prompt_logprobs(server.url, PROMPT + ids))
    assert version == 1 and read_json(paths.weight_sync)["backend"] == "gloo"
    expected = probe_logprobs(peft_model(tiny_model_dir, paths.checkpoint_dir(1)), PROMPT + ids)
    assert max_diff(served, expected) < 1e-5 and max_diff(probe_logprobs(hf_model(tiny_model_dir), PROMPT + ids),
                                                          expected) > 1e-3  # fmt: skip


def served_prompt_logprobs(url: str, ids: list[int], lora: str | None = None) -> list[float]:
    """The engine's own log-probabilities of `ids` (its prompt log-probs, as the publication's probe reads them),
    from the LoRA adapter `lora` (None: the served weights)."""
    import asyncio

    from pipeline.engine.client import EngineClient

    async def go() -> list[float]:
        async with EngineClient([url], health_interval_s=0) as client:
            scored = await client.score_prompt(url, ids, lora_path=lora)
        return [float(entry[0]) for entry in scored[1:]]  # the first token has no log-probability

    return asyncio.run(go())


def test_step_rerun_from_a_lora_checkpoint_is_bitwise(make_train_run) -> None:
    """`--step 1` loads version 1's adapter, optimizer (adapter parameters only, in LoRA+'s two groups) and RNG
    state: exact resume."""
    paths = make_train_run(steps=[0, 1], overrides=[*LORA, "num_steps=2", "trainer.deterministic=true",
                                                    "trainer.lora.dropout=0.1", "trainer.minibatches=2",
                                                    "trainer.lora.lr_ratio=4", NORMS])  # fmt: skip
    run_trainer(StageContext.from_run_dir("train", paths.root))
    adapter = load_file(str(paths.checkpoint_dir(2) / "adapter_model.safetensors"))
    optimizer = torch.load(paths.trainer_state_dir(2) / "optimizer.pt", weights_only=False)
    assert all(".lora_" in name or ".modules_to_save." in name for name in optimizer["state"])
    groups = optimizer["param_groups"]
    assert [g["initial_lr"] for g in groups] == [0.01, 0.04]  # A (and nothing else) at lr, B and norms faster
    assert all(".lora_A." in name for name in groups[0]["params"])
    assert {name for name in groups[1]["params"] if ".lora_B." not in name} == {
        n for n in optimizer["state"] if n.endswith("norm.modules_to_save.default.weight")
    }
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(optimizer["state"])
    run_trainer(StageContext.from_run_dir("train", paths.root, only_step=1))
    again = load_file(str(paths.checkpoint_dir(2) / "adapter_model.safetensors"))
    assert adapter.keys() == again.keys()
    assert all(torch.equal(adapter[k], again[k]) for k in adapter)


@pytest.mark.slow
def test_two_process_fsdp_lora_equals_single_process(make_train_run) -> None:
    overrides = [*LORA, NORMS, "num_steps=2", "trainer.minibatches=2", "trainer.micro_batch_tokens=64"]
    single, sharded = train_single_and_sharded(make_train_run, overrides)
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        a, b = (load_file(str(p.checkpoint_dir(2) / name)) for p in (single, sharded))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-4, msg=f"{name}: {key}")


def test_run_paths_serve_the_merged_model_of_a_lora_checkpoint(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    (paths.checkpoint_dir(3) / "merged").mkdir(parents=True)
    (paths.checkpoint_dir(4)).mkdir()
    assert paths.weights_dir(3) == paths.checkpoint_dir(3) / "merged"
    assert paths.weights_dir(4) == paths.checkpoint_dir(4)


def test_adapter_publication_serves_each_version_as_its_own_adapter(make_train_run, tiny_model_dir: Path) -> None:
    """`publish: adapter`: the server loads each version's PEFT checkpoint by `/load_lora_adapter` (no merged model
    is written), serves it as PEFT's base + adapter, keeps its base weights, and holds the last two versions."""
    import asyncio
    import threading
    import time

    import httpx

    from pipeline.engine.client import EngineClient
    from pipeline.engine.inference.servers import ServerStart, start_server, wait_healthy
    from pipeline.engine.inference.supervise import load_adapter, terminate
    from pipeline.net.addresses import free_port
    from pipeline.run.weight_version import AnnouncedAdapter

    paths = make_train_run(steps=[0, 1, 2], overrides=[*LORA, "num_steps=3", "trainer.lora.publish=adapter"])
    with start_hf_server(tiny_model_dir, seed=0) as server:
        register(paths, "s0", server.url, tiny_model_dir)
        run_trainer(StageContext.from_run_dir("train", paths.root))  # publishes versions 0..3, verified
        deadline = time.monotonic() + 30  # the unload of version 1 is started, not awaited, by the publisher
        while set(httpx.get(f"{server.url}/server_info").json()["lora_adapters"]) != {"arl-lora-v2", "arl-lora-v3"}:
            assert time.monotonic() < deadline, httpx.get(f"{server.url}/server_info").json()["lora_adapters"]
            time.sleep(0.2)

        async def generate() -> tuple[list[int], list[int]]:
            async with EngineClient([server.url], health_interval_s=0, adapter=AnnouncedAdapter(paths)) as client:
                result = await client.generate(PROMPT, {"max_new_tokens": 6, "ignore_eos": True})
                return result.output_ids, result.output_versions

        ids, versions = asyncio.run(generate())
        probe = PROMPT + ids
        served = served_prompt_logprobs(server.url, probe, lora="arl-lora-v3")
        base_served = served_prompt_logprobs(server.url, probe)
        assert httpx.get(f"{server.url}/model_info").json()["weight_version"] == "3"
    assert versions == [3] * 6 and read_json(paths.weight_version)["checkpoint"] == "checkpoints/step_000003"
    assert not any((paths.checkpoint_dir(v) / "merged").exists() for v in (2, 3))
    expected = probe_logprobs(peft_model(tiny_model_dir, paths.checkpoint_dir(3)), probe)  # plain PEFT
    assert max_diff(torch.tensor(served), expected) < 1e-5
    base = probe_logprobs(hf_model(tiny_model_dir), probe)
    assert max_diff(torch.tensor(base_served), base) < 1e-5 and max_diff(base, expected) > 1e-3

    # A server (re)started on the checkpoint serves base + adapter, as the inference stage and `arl eval` do.
    from pipeline.eval.offline import pick_weights

    config = StageContext.from_run_dir("train", paths.root).config
    assert pick_weights(paths, config, 3, None) == (str(paths.checkpoint_dir(3)), 3)  # `arl eval --step 3`
    assert pick_weights(paths, config, None, paths.checkpoint_dir(3)) == (str(paths.checkpoint_dir(3).resolve()), 3)
    start = ServerStart(index=0, port=free_port(), model_path=str(paths.weights_dir(3)), version=3, attempt=1)
    fresh = start_server(paths, config, start)
    try:
        assert fresh.adapter == ("arl-lora-v3", str(paths.checkpoint_dir(3).resolve()))
        wait_healthy([fresh], 120, threading.Event())
        with httpx.Client() as http:
            load_adapter(http, fresh)
        assert max_diff(torch.tensor(served_prompt_logprobs(fresh.url, probe, lora="arl-lora-v3")), expected) < 1e-5
    finally:
        terminate(fresh)
