"""arl's policy loss judged by TRL's: the same samples, weights, old and reference log-probs give the same loss and
the same gradient in TRL 1.16's `GRPOTrainer._compute_loss` as in arl's trainer (`TorchBackend.train_minibatch`
with `policy_loss`, micro-batches planned by `plan_step`, as the trainer loop runs them).

The options are set as `benchmarks/_trl_align.grpo_config_kwargs` sets them (docs/trainer.md, "arl vs TRL's
GRPO"): token-mean loss (`dapo` / `token`), PPO clip, k3 KL to the reference not multiplied by the ratio,
temperature-scaled log-probs. The old (behaviour) log-probs are the policy's own plus noise, so a share of the
ratios leaves the clip range, and the reference is a different model, so the KL term has a gradient.

A whole step is judged too: TRL's own training loop (`GRPOTrainer.train`, only its generation replaced by the
given samples and its shuffle by arl's minibatch split) and arl's `Trainer.plan` + `Trainer.update` take the four
minibatch updates of one generation from the same weights, and end on the same weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.run.config import load_config
from pipeline.trainer.advantages import compute_advantages
from pipeline.trainer.data import Sample
from pipeline.trainer.losses import LossOutput, TokenBatch, policy_loss
from pipeline.trainer.packing import plan_step
from pipeline.trainer.torch_backend import TorchBackend

trl = pytest.importorskip("trl", reason="TRL is the judge here (the dev extra installs it)")

TEMPERATURE = 0.7
KL_COEF = 0.05
CLIP = 0.2
GROUPS, GROUP_SIZE = 3, 4


@pytest.fixture(scope="module")
def policy_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight moved a little: the policy being trained (the reference is the original)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    out = tmp_path_factory.mktemp("policy")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(out)
    return out


def _samples(policy_dir: Path) -> list[Sample]:
    """Groups of completions of one prompt each; behaviour log-probs = the policy's own + noise in [-0.4, 0.4]."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    samples = []
    for g in range(GROUPS):
        prompt = rng.integers(0, vocab, size=5 + 2 * g).tolist()
        for i in range(GROUP_SIZE):
            completion = rng.integers(0, vocab, size=1 + (g + i) % 6).tolist()
            ids = np.array(prompt + completion)
            with torch.no_grad():
                logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1].float() / TEMPERATURE
            own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
            logprobs = np.concatenate([[0.0], own]) + rng.uniform(-0.4, 0.4, size=len(ids))
            mask = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int8)
            logprobs = np.where(mask == 1, logprobs, 0.0).astype(np.float32)
            samples.append(Sample(f"s{g}.{i}", f"g{g}", ids, mask, logprobs, np.where(mask == 1, 0, -1),
                                  float(rng.uniform(0, 1))))  # fmt: skip
    return samples


def _arl(tiny_model_dir: Path, policy_dir: Path, samples: list[Sample], packing: str) -> tuple[float, dict[str, Any]]:
    """arl's loss and gradient for one minibatch of `samples` (a negligible lr, no clipping: grads stay as computed)."""
    config = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=cpu", f"trainer.packing={packing}",
                                f"rollout.temperature={TEMPERATURE}", "trainer.algorithm.decoupled=false",
                                f"trainer.algorithm.kl_coef={KL_COEF}", f"trainer.algorithm.clip_eps={CLIP}",
                                "trainer.algorithm.loss_agg=token", "trainer.optimizer.lr=1e-12",
                                "trainer.optimizer.grad_clip=1e9"])  # fmt: skip
    advantages = _advantages(samples)
    backend = TorchBackend(config, total_updates=1)
    try:
        backend.load(policy_dir, None)
        (minibatch,) = plan_step(samples, advantages, minibatches=1, budget=4096, agg="token", seed=0,
                                 step=0, layout=backend.layout)  # fmt: skip
        for micro in minibatch:
            micro.tokens.ref_logp = backend.logprobs(micro, reference=True) * micro.tokens.mask
        losses: list[float] = []

        def loss_fn(logp: torch.Tensor, entropy: torch.Tensor | None, batch: TokenBatch) -> LossOutput:
            out = policy_loss(logp, entropy, batch, config.trainer.algorithm)
            losses.append(float(out.loss))
            return out

        backend.train_minibatch(minibatch, loss_fn)
        grads = {name: p.grad.detach().clone() for name, p in backend.model.named_parameters()}
    finally:
        backend.close()
    return sum(losses), grads


def _advantages(samples: list[Sample]) -> np.ndarray:
    return compute_advantages([s.reward for s in samples], [s.group_id for s in samples], "grpo")


def _trl(tiny_model_dir: Path, policy_dir: Path, samples: list[Sample], tmp_path: Path) -> tuple[float, dict[str, Any]]:
    """TRL's loss and gradient for the same samples, through `GRPOTrainer._compute_loss` itself."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=GROUP_SIZE,
                          per_device_train_batch_size=len(samples), gradient_accumulation_steps=1,
                          steps_per_generation=1, temperature=TEMPERATURE,
                          beta=KL_COEF, use_bias_correction_kl=False, epsilon=CLIP, loss_type="dapo",
                          scale_rewards="group", bf16=False, gradient_checkpointing=False, report_to=[],
                          max_completion_length=8, use_cpu=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_list([{"prompt": "x"}] * GROUP_SIZE))  # fmt: skip
    inputs = _trl_inputs(samples, trainer, tiny_model_dir)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the HF Trainer's training loop before each step
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss), {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()}


def _trl_inputs(samples: list[Sample], trainer: Any, reference_dir: Path) -> dict[str, torch.Tensor]:
    """What `_generate_and_score_completions` hands `_compute_loss`: left-padded prompts, right-padded completions,
    advantages by TRL's own group scaling, the old log-probs (arl's behaviour ones) and the reference's."""
    from transformers import AutoModelForCausalLM

    # arl's advantages: the loss is judged here, and TRL's group scaling differs by its epsilon (1e-4 vs 1e-6,
    # docs/trainer.md), which would move the figures by ~3e-4 of their size.
    advantages = torch.tensor(_advantages(samples), dtype=torch.float32)
    # TRL made its reference from the policy's directory; give it the original weights (its own patched LM head,
    # with TRL's temperature scaling, stays)
    original = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32)
    trainer.ref_model.load_state_dict(original.state_dict())
    return {**_generation_batch(samples, trainer), "advantages": advantages}


def _generation_batch(samples: list[Sample], trainer: Any) -> dict[str, Any]:
    """`samples` as TRL's `_generate_and_score_completions` returns a generation (advantages aside): left-padded
    prompts, right-padded completions, arl's behaviour log-probs as TRL's old ones, the reference's log-probs."""
    prompts = [s.input_ids[s.loss_mask == 0] for s in samples]
    completions = [s.input_ids[s.loss_mask == 1] for s in samples]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[0] * (width_p - len(p)) + p.tolist() for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c.tolist() + [0] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    old = torch.tensor([s.logprobs[s.loss_mask == 1].tolist() + [0.0] * (width_c - int(s.loss_mask.sum()))
                        for s in samples])  # fmt: skip
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, input_ids, attention_mask, width_c)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "old_per_token_logps": old, "ref_per_token_logps": ref,
            "num_items_in_batch": completion_mask.sum()}  # fmt: skip


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_arl_loss_and_gradient_equal_trls(tiny_model_dir: Path, policy_dir: Path, tmp_path: Path,
                                          packing: str) -> None:  # fmt: skip
    samples = _samples(policy_dir)
    arl_loss, arl_grads = _arl(tiny_model_dir, policy_dir, samples, packing)
    trl_loss, trl_grads = _trl(tiny_model_dir, policy_dir, samples, tmp_path)
    assert math.isfinite(arl_loss) and abs(arl_loss) > 1e-3  # a loss that could differ
    assert arl_loss == pytest.approx(trl_loss, rel=1e-4, abs=1e-6), (arl_loss, trl_loss)
    assert arl_grads.keys() == trl_grads.keys()
    scale = max(float(g.abs().max()) for g in trl_grads.values())
    worst = max(float((arl_grads[k] - trl_grads[k]).abs().max()) for k in trl_grads)
    assert scale > 1e-4 and worst <= 1e-4 * scale, (worst, scale)


# --------------------------------------------------------------------------- a whole step: four updates

STEP_MINIBATCHES, STEP_SAMPLES = 4, 16
STEP_OPTIONS = {"lr": 3e-3, "eps": 1e-6, "grad_clip": 0.5, "seed": 5}


def _step_samples(model_dir: Path) -> tuple[list[Sample], list[list[int]]]:
    """Four groups of four completions of one prompt each, behaviour log-probs the model's own (sync: the sampler
    held these weights), and arl's minibatch split of them. Completion lengths 1..4 within every minibatch, so each
    minibatch holds the same number of tokens: TRL's `dapo` divides every update by the generation's tokens / 4,
    arl by the minibatch's own, which then agree (docs/trainer.md)."""
    from transformers import AutoModelForCausalLM

    from pipeline.trainer.packing import split_minibatches

    split = split_minibatches(STEP_SAMPLES, STEP_MINIBATCHES, STEP_OPTIONS["seed"], 0)
    length = {i: 1 + position for members in split for position, i in enumerate(members)}
    rng = np.random.default_rng(3)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, size=4 + g).tolist() for g in range(STEP_SAMPLES // GROUP_SIZE)]
    samples = []
    for i in range(STEP_SAMPLES):
        prompt, completion = prompts[i // GROUP_SIZE], rng.integers(0, vocab, size=length[i]).tolist()
        ids = np.array(prompt + completion)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1].float() / TEMPERATURE
        own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        mask = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int8)
        logprobs = np.where(mask == 1, np.concatenate([[0.0], own]), 0.0).astype(np.float32)
        samples.append(Sample(f"s{i}", f"g{i // GROUP_SIZE}", ids, mask, logprobs, np.where(mask == 1, 0, -1),
                              float(rng.integers(0, 6)) / 5))  # the demo's reward grid: 0, 0.2, ..., 1  # fmt: skip
    return samples, split


def _arl_step(tmp_path: Path, model_dir: Path, samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The weights after arl's trainer (`Trainer.plan` + `Trainer.update`, as `train_step` runs them) takes one
    step of four minibatch updates from the initial model, which is also the KL reference."""
    from pipeline.run.config import dump_config
    from pipeline.run.handoff import write_text_atomic
    from pipeline.run.paths import RunPaths
    from pipeline.trainer.data import StepData
    from pipeline.trainer.loop import Trainer
    from pipeline.trainer.metrics import Timings

    opt = STEP_OPTIONS
    config = load_config(None, [f"fileroot={tmp_path}", "experiment_name=x", "trial_name=step",
                                f"model.path={model_dir}", "trainer.device=cpu", "num_steps=1",
                                f"rollout.temperature={TEMPERATURE}", f"trainer.minibatches={STEP_MINIBATCHES}",
                                f"trainer.seed={opt['seed']}", "trainer.algorithm.advantage=grpo",
                                f"trainer.algorithm.kl_coef={KL_COEF}", f"trainer.algorithm.clip_eps={CLIP}",
                                "trainer.algorithm.loss_agg=token", f"trainer.optimizer.lr={opt['lr']}",
                                f"trainer.optimizer.eps={opt['eps']}",
                                f"trainer.optimizer.grad_clip={opt['grad_clip']}",
                                "trainer.optimizer.weight_decay=0.0", "trainer.optimizer.schedule=constant",
                                "trainer.optimizer.warmup_steps=0"])  # fmt: skip
    assert config.trainer.algorithm.decoupled, "the demo's setting: proximal log-probs recomputed once per step"
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    write_text_atomic(paths.config, dump_config(config))
    trainer = Trainer(config, paths)
    try:
        trainer.start_from(0)
        advantages = compute_advantages([s.reward for s in samples], [s.group_id for s in samples], "grpo")
        plan = trainer.plan(StepData(0, samples), advantages, 0)
        assert len(plan) == STEP_MINIBATCHES
        trainer.update(plan, Timings())
        backend = trainer.backend
        assert isinstance(backend, TorchBackend)
        return {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    finally:
        trainer.close()


def _trl_step(tmp_path: Path, model_dir: Path, samples: list[Sample], split: list[list[int]],
              monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, torch.Tensor], list[float]]:  # fmt: skip
    """The weights after TRL's own training loop (`GRPOTrainer.train`: its minibatch buffering, `_compute_loss`,
    the HF Trainer's AdamW, scheduler and gradient clipping) takes the four updates of one generation made of the
    same samples. Only generation is replaced (the samples are given, not sampled), and TRL's shuffle of the
    generation is replaced by arl's split, so each update sees the same samples on both sides."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    order = [i for members in split for i in members]
    ordered = [samples[i] for i in order]
    advantages = _advantages(samples)[order]
    opt = STEP_OPTIONS

    class Given(trl.GRPOTrainer):
        def _generate_and_score_completions(self, generation_batch: Any) -> dict[str, Any]:
            inputs = _generation_batch(ordered, self)
            inputs["advantages"] = torch.tensor(advantages, dtype=torch.float32)
            return inputs

    norms: list[float] = []

    class GradNorms(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "grad_norm" in logs:
                norms.append(float(logs["grad_norm"]))

    monkeypatch.setattr("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl-step"), seed=opt["seed"], use_cpu=True,
                          num_generations=GROUP_SIZE, per_device_train_batch_size=STEP_SAMPLES // STEP_MINIBATCHES,
                          gradient_accumulation_steps=1, steps_per_generation=STEP_MINIBATCHES, num_iterations=1,
                          max_steps=STEP_MINIBATCHES, temperature=TEMPERATURE, max_completion_length=8,
                          learning_rate=opt["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                          adam_epsilon=opt["eps"], weight_decay=0.0, max_grad_norm=opt["grad_clip"],
                          beta=KL_COEF, use_bias_correction_kl=False, epsilon=CLIP, loss_type="dapo",
                          scale_rewards="group", bf16=False, gradient_checkpointing=False, report_to=[],
                          logging_steps=1, save_strategy="no", disable_tqdm=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trainer = Given(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                    train_dataset=Dataset.from_list([{"prompt": "x"}] * STEP_SAMPLES),
                    callbacks=[GradNorms()])  # fmt: skip
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}, norms


def test_a_step_of_four_minibatch_updates_lands_on_trls_weights(tiny_model_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """One sync step as the demo takes it (several minibatch updates of one generation, the old log-probs held
    for all of them, KL to the initial model, AdamW, clipping on the global norm): arl's weights after the step
    are TRL's. A wrong minibatch, a proximal log-prob refreshed per update, a different normaliser or learning
    rate, or clipping on one side only would each move some weight by a sizeable share of its update."""
    samples, split = _step_samples(tiny_model_dir)
    arl_weights = _arl_step(tmp_path, tiny_model_dir, samples)
    trl_weights, norms = _trl_step(tmp_path, tiny_model_dir, samples, split, monkeypatch)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    start = {name: p.detach() for name, p in initial.named_parameters()}
    assert len(norms) == STEP_MINIBATCHES and max(norms) > STEP_OPTIONS["grad_clip"], norms  # clipping engaged
    assert arl_weights.keys() == trl_weights.keys()
    moved = max(float((trl_weights[k] - start[k]).abs().max()) for k in trl_weights)
    worst = max(float((arl_weights[k] - trl_weights[k]).abs().max()) for k in trl_weights)
    print(f"largest update {moved:.3e}, largest arl - TRL difference {worst:.3e}, TRL grad norms {norms}")
    assert moved > 0.5 * STEP_MINIBATCHES * STEP_OPTIONS["lr"], moved  # Adam moves some weights by ~lr an update
    assert worst <= 1e-3 * moved, (worst, moved)
