"""Time of one PPO update on ragged completions: fixed micro-batches against ``max_tokens_per_microbatch``.

Run ``python benchmarks/bench_update.py`` (``--quick`` for a smoke run). One fixed rollout batch (RLVR-like
lengths: most completions short, a few at ``response_length``) and one ``SAEPPOTrainer``; its ``ppo_update`` is
timed with ``per_device_train_batch_size`` rows per micro-batch (every micro-batch padded to the longest
completion of the batch) and with a token budget (rows grouped by length, each micro-batch trimmed to its
own longest row). Both take one optimizer step over the same mini-batch; with ``loss_agg_mode`` the loss does
not depend on the split, so the script also prints the largest difference of the logged losses and of the
parameters after the step (plain SGD, no clipping: Adam's first step is about ``lr * sign(grad)`` and would
hide a wrong gradient scale).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from trl_sae.trainer.rollout_batch import RolloutBatch


def ragged_lengths(batch: int, response_length: int, long_rows: int, seed: int = 0) -> list[int]:
    """``long_rows`` completions at ``response_length``, the rest uniform in [response_length/32, /8]."""
    generator = torch.Generator().manual_seed(seed)
    low, high = max(response_length // 32, 1), max(response_length // 8, 2)
    short = torch.randint(low, high + 1, (batch - long_rows,), generator=generator).tolist()
    return [response_length] * long_rows + short


def build(args: argparse.Namespace) -> tuple[SAEPPOTrainer, RolloutBatch]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(
        tokenizer,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        max_position_embeddings=args.prompt_len + args.response_length,
    )
    config = SAEPPOConfig(
        output_dir="/tmp/bench_update", per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch, num_generations=1, advantage_estimator="gae",
        response_length=args.response_length, num_ppo_epochs=1, num_mini_batches=1, max_grad_norm=0.0,
        report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None,
    )  # fmt: skip
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=lambda prompts, completions, completion_ids, **kw: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"P{i}" for i in range(args.batch)]}),
        processing_class=tokenizer,
    )
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    trainer.optimizer.optimizer = torch.optim.SGD(
        [p for p in unwrapped.parameters() if p.requires_grad], lr=0.1
    )

    generator = torch.Generator().manual_seed(1)
    lengths = ragged_lengths(args.batch, args.response_length, args.long_rows)
    width, num = args.response_length, args.batch
    completion_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    valid = completion_mask.bool()
    pad = tokenizer.pad_token_id
    prompt_ids = torch.randint(5, 40, (num, args.prompt_len), generator=generator)
    completion_ids = torch.where(valid, torch.randint(5, 40, (num, width), generator=generator), pad)

    def noise(scale: float, shift: float = 0.0) -> torch.Tensor:
        return torch.where(
            valid, shift + scale * torch.randn(num, width, generator=generator), torch.zeros(())
        )

    batch = RolloutBatch(
        prompts=[""] * num, columns={}, prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids, completion_mask=completion_mask,
        logprobs=noise(0.1, shift=-float(torch.log(torch.tensor(float(len(tokenizer)))))),
        entropies=torch.zeros(num, width), is_truncated=torch.zeros(num, dtype=torch.bool),
    )  # fmt: skip
    batch.advantages, batch.values, batch.returns = noise(1.0), noise(0.1), noise(1.0)
    return trainer, batch


def run_update(
    trainer: SAEPPOTrainer, batch: RolloutBatch, budget: int | None
) -> tuple[float, dict, torch.Tensor]:
    """Seconds of one ``ppo_update.run``, its logged losses and the parameters after it (then put back)."""
    parameters = [p for p in trainer.accelerator.unwrap_model(trainer.model).parameters() if p.requires_grad]
    before = [p.detach().clone() for p in parameters]
    trainer.args.max_tokens_per_microbatch = budget
    torch.manual_seed(0)
    start = time.perf_counter()
    stats = trainer.ppo_update.run(batch, trainer.state.global_step)
    seconds = time.perf_counter() - start
    after = torch.cat([p.detach().flatten().clone() for p in parameters])
    with torch.no_grad():
        for p, b in zip(parameters, before):
            p.copy_(b)
    return seconds, {key: float(value) for key, value in stats.items() if key.startswith("loss/")}, after


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="response_length 128, batch 16, 1 repeat")
    parser.add_argument("--batch", type=int, default=32, help="completions in the one mini-batch")
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="per_device_train_batch_size (fixed split)"
    )
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--long-rows", type=int, default=4, help="completions at response_length")
    parser.add_argument(
        "--budget", type=int, default=None, help="max_tokens_per_microbatch (default: one full row x 4)"
    )
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per variant (median printed)")
    # One thread by default: on a shared CPU, OpenMP threads spinning against other jobs dominate the time.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.response_length, args.repeats, args.micro_batch = 16, 128, 1, 4
    if args.budget is None:
        args.budget = 4 * (args.prompt_len + args.response_length)
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer, batch = build(args)
    lengths = batch.lengths.tolist()
    padded = args.batch * (args.prompt_len + args.response_length)
    real = sum(lengths) + args.batch * args.prompt_len
    print(
        f"batch {args.batch} completions, lengths: {args.long_rows} x {args.response_length}, the rest "
        f"{min(lengths)}-{sorted(lengths)[-args.long_rows - 1]} (mean {statistics.mean(lengths):.0f}); prompt "
        f"{args.prompt_len}; model hidden {args.hidden_size} x {args.layers} layers; "
        f"threads {torch.get_num_threads()}; real/padded tokens {real}/{padded}"
    )
    run_update(trainer, batch, None)  # warm-up
    results = {}
    for name, budget in (("fixed", None), ("budget", args.budget)):
        runs = [run_update(trainer, batch, budget) for _ in range(args.repeats)]
        results[name] = (statistics.median(r[0] for r in runs), runs[0][1], runs[0][2])
    groups = trainer.ppo_update.micro_batches(batch, torch.arange(args.batch))
    print(
        f"fixed: {args.batch // args.micro_batch} micro-batches x {args.micro_batch} rows; budget "
        f"{args.budget} tokens: {len(groups)} micro-batches of {[len(g) for g in groups]} rows"
    )
    print("| split | update (s) | loss/policy | loss/value |")
    print("|---|---|---|---|")
    for name, (seconds, losses, _) in results.items():
        print(f"| {name} | {seconds:.3f} | {losses['loss/policy']:.7f} | {losses['loss/value']:.7f} |")
    fixed, budget = results["fixed"], results["budget"]
    loss_diff = max(abs(fixed[1][key] - budget[1][key]) for key in fixed[1])
    model = trainer.accelerator.unwrap_model(trainer.model)
    start = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    step = (fixed[2] - start).abs().max()
    print(
        f"speed-up {fixed[0] / budget[0]:.2f}x; max |loss difference| {loss_diff:.2e}; max |parameter difference| "
        f"{(fixed[2] - budget[2]).abs().max():.2e} (largest parameter change of the step {step:.2e})"
    )


if __name__ == "__main__":
    main()
