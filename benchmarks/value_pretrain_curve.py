"""How far a critic's held-out explained variance goes on SmolLM2-135M's initial policy (issue 50 item 2).

The task is ``real_model_gym.py --long-task`` (chains of 3-4 numbers added up, worked-step few-shot
examples, 128 completion tokens) unless ``--task-config`` names another ``basic_arithmetic`` chain (worked-step
examples too), on one tuning seed. Three stages, each one resumable job whose JSON is
written under ``--output-dir`` when it ends (``--commit``: committed at once):

1. **bank** (``bank-seed<S>.json``): ``--held-out`` + ``--rollouts`` completions sampled from the initial
   LoRA policy by the trainer's own value pretraining (its prompt order, held-out prompts disjoint from the
   fitting ones, lambda = 1 returns), kept in ``<work-dir>/seed-<S>/bank/value_pretrain/rollouts/rank-0.pt``;
   its statistics: sampling seconds, rollouts/s, completion length, SAE boundaries per completion (the
   probability segmenter at the trainer's ``segment_threshold``), pass rate, prompts with mixed outcomes.
2. **probe** (``probe-seed<S>.json``): one forward pass of the frozen base model over the bank; for every
   decoder layer a ridge regression from the state before each completion token (as the head critic reads
   it: the final norm's output for the last layer, RMS-normalised for the others) to its return, fitted on
   the first n fitting rollouts for each n of ``--sizes`` (ridge strength chosen on the last quarter of
   those n rollouts' prompts, never on the held-out ones), scored on the held-out rollouts with the trainer's
   ``explained_variance``. What a head critic with a frozen trunk converges to.
3. **fit** (``fit-seed<S>-<critic>.json`` for each of ``--fits``): the trainer's value pretraining on the
   saved bank, resumed from a copy of it (no resampling), at most ``--epochs`` epochs with patience
   ``--patience``: held-out explained variance and loss per epoch, seconds per epoch.

``--report`` (also run at the end of every sweep) writes ``results.md`` from the JSONs found. Tuning seeds
(100-103) only: the fresh seeds are reserved for the pre-registered comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

ROOT = Path(__file__).resolve().parent
DEFAULT_OUTPUT = ROOT / "results" / "value_pretrain_curve"
TUNING_SEEDS = (100, 101, 102, 103)  # real_model_gym.TUNING_SEEDS (not imported: that pulls in scipy)
BATCH = 32  # completions per rollout batch: 8 prompts x 4, as real_model_gym's runs
MICRO = 8  # completions per forward / update micro-batch
# Optimizer steps per pass over a rollout batch of 32 in the fits (mini-batches of 8): more critic steps per
# forward pass, which is what a fit epoch costs here.
FIT_MINI_BATCHES = 4
# The critics the fit stage trains by default: (value_model, value_head_layer, value_pretrain_learning_rate).
# Any name of the same form is accepted (:func:`parse_fit`): head-last-lr<lr>, head-l<layer>-lr<lr>, shared-lr<lr>.
FITS: dict[str, tuple[str, int | None, float]] = {
    "head-last-lr1e-3": ("head", None, 1e-3),
    "head-last-lr1e-4": ("head", None, 1e-4),
    "head-l15-lr1e-3": ("head", 15, 1e-3),
    "shared-lr5e-4": ("shared", None, 5e-4),
}
RIDGE_ALPHAS = tuple(10.0**k for k in range(-2, 6))
FIT_NAME = re.compile(
    r"(?:head-(?:last|l(?P<layer>\d+))|(?P<shared>shared))-lr(?P<lr>\d+(?:\.\d+)?(?:e-?\d+)?)"
)


def parse_fit(name: str) -> tuple[str, int | None, float]:
    """``head-last-lr1e-3`` -> ``("head", None, 0.001)``, ``head-l20-lr3e-4`` -> ``("head", 20, 0.0003)``,
    ``shared-lr5e-4`` -> ``("shared", None, 0.0005)``; argparse's error for any other name."""
    match = FIT_NAME.fullmatch(name)
    if match is None or float(match["lr"]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{name!r}: a critic is head-last-lr<lr>, head-l<layer>-lr<lr> or shared-lr<lr> (e.g. head-l20-lr1e-3)"
        )
    layer = int(match["layer"]) if match["layer"] is not None else None
    return ("shared" if match["shared"] else "head", layer, float(match["lr"]))


def _fit_name(name: str) -> str:
    parse_fit(name)
    return name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=100, help="a tuning seed (100-103)")
    parser.add_argument(
        "--rollouts", type=int, default=256, help="fitting rollouts in the bank (a multiple of 32)"
    )
    parser.add_argument(
        "--held-out", type=int, default=64, help="held-out rollouts in the bank (a multiple of 32)"
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="fitting rollouts the probe is fitted on (default: 32, 64, 128, ... up to --rollouts)",
    )
    parser.add_argument(
        "--fits",
        nargs="*",
        default=list(FITS),
        type=_fit_name,
        help="the critics the fit stage trains, in this order (none: bank and probe only): head-last-lr<lr>, "
        f"head-l<layer>-lr<lr> or shared-lr<lr> (default: {' '.join(FITS)})",
    )
    parser.add_argument(
        "--fit-rollouts",
        type=int,
        default=None,
        help="the first this many of the bank's fitting rollouts are what each fit trains on (a multiple of 32; "
        "default: all of them); a fit epoch costs a forward pass over them and the held-out ones",
    )
    parser.add_argument(
        "--task-config",
        type=json.loads,
        default=None,
        help="another basic_arithmetic chain, as JSON (real_model_gym's --task-config with --worked-steps); "
        "default: the long task. Give each task its own --output-dir",
    )
    parser.add_argument(
        "--response-length", type=int, default=None, help="completion tokens (default: the long task's 128)"
    )
    parser.add_argument(
        "--lora-layers",
        type=int,
        default=None,
        help="the policy's LoRA on the last N decoder layers (real_model_gym's --lora-layers; default: every "
        "layer): a fit's saved critic loads only into runs with the same LoRA (value_pretrain_path)",
    )
    parser.add_argument("--epochs", type=int, default=6, help="value_pretrain_epochs of each fit")
    parser.add_argument("--patience", type=int, default=2, help="value_pretrain_patience of each fit")
    parser.add_argument("--no-probe", action="store_true", help="skip the probe stage")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="where the JSONs go")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="the bank and the fits' output folders (default: --output-dir/work, git-ignored)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--commit", action="store_true", help="git-commit each JSON as it is written")
    parser.add_argument("--report", action="store_true", help="only write results.md from the JSONs")
    args = parser.parse_args(argv)
    if args.seed not in TUNING_SEEDS:
        parser.error(
            f"--seed {args.seed}: tuning seeds only ({list(TUNING_SEEDS)}); fresh seeds are reserved"
        )
    for name in ("rollouts", "held_out"):
        value = getattr(args, name)
        if value < BATCH or value % BATCH:
            parser.error(f"--{name.replace('_', '-')} {value}: a positive multiple of {BATCH}")
    if args.sizes is None:
        args.sizes = default_sizes(args.rollouts)
    bad = [n for n in args.sizes if not 4 <= n <= args.rollouts or n % 4]
    if bad:
        parser.error(
            f"--sizes {bad}: each a multiple of 4 (whole prompts) in [4, --rollouts {args.rollouts}]"
        )
    args.sizes = sorted(set(args.sizes))
    if args.fit_rollouts is None:
        args.fit_rollouts = args.rollouts
    if not BATCH <= args.fit_rollouts <= args.rollouts or args.fit_rollouts % BATCH:
        parser.error(f"--fit-rollouts {args.fit_rollouts}: a multiple of {BATCH} in [{BATCH}, --rollouts]")
    if args.epochs < 1 or args.patience < 1:
        parser.error("--epochs and --patience: at least 1")
    if args.work_dir is None:
        args.work_dir = args.output_dir / "work"
    return args


def default_sizes(rollouts: int) -> list[int]:
    """32, 64, 128, ... below ``rollouts``, then ``rollouts`` itself."""
    sizes, n = [], 32
    while n < rollouts:
        sizes.append(n)
        n *= 2
    return [*sizes, rollouts]


# --------------------------------------------------------------------------------------------------
# Pure helpers (tested in tests/test_value_pretrain_curve.py)
# --------------------------------------------------------------------------------------------------
def bank_statistics(
    scores: torch.Tensor, mask: torch.Tensor, boundaries: torch.Tensor, num_generations: int
) -> dict[str, float]:
    """Pass rate, mean completion tokens, SAE boundaries per completion and the share of prompts (groups of
    ``num_generations`` consecutive completions) whose completions do not all score the same."""
    groups = scores.float().view(-1, num_generations)
    mixed = (groups.max(dim=1).values != groups.min(dim=1).values).float()
    return {
        "completions": int(scores.numel()),
        "pass_rate": float((scores > 0.5).float().mean()),
        "mean_score": float(scores.float().mean()),
        "mean_completion_tokens": float(mask.float().sum(dim=1).mean()),
        "mean_boundaries": float((boundaries & mask.bool()).float().sum(dim=1).mean()),
        "mixed_prompts": float(mixed.mean()),
        "between_prompt_share": between_prompt_share(scores, num_generations),
        "prompts": int(groups.shape[0]),
    }


def between_prompt_share(scores: torch.Tensor, num_generations: int) -> float:
    """The share of the score's variance that lies between prompts (one-way ANOVA over groups of
    ``num_generations`` consecutive completions: between / (between + within), the between part corrected for
    the within-group noise in each group's mean). A critic that knew each prompt's pass rate exactly, and
    nothing of its completion, explains about this share of the final-token return; past it, a critic must
    read the completion (e.g. spot a wrong line)."""
    groups = scores.double().view(-1, num_generations)
    within = groups.var(dim=1, unbiased=True).mean()
    between = (groups.mean(dim=1).var(unbiased=True) - within / num_generations).clamp_min(0.0)
    total = between + within
    return float(between / total) if total > 0 else 0.0


def ridge_fit(features: torch.Tensor, targets: torch.Tensor, alpha: float) -> tuple[torch.Tensor, ...]:
    """Closed-form ridge on standardised ``(N, D)`` features (the intercept unpenalised): ``(mean, scale,
    weights, bias)`` for :func:`ridge_predict`."""
    x = features.double()
    mean, scale = x.mean(dim=0), x.std(dim=0).clamp_min(1e-6)
    z = (x - mean) / scale
    y = targets.double()
    bias = y.mean()
    gram = z.T @ z + alpha * torch.eye(z.shape[1], dtype=z.dtype)
    weights = torch.linalg.solve(gram, z.T @ (y - bias))
    return mean, scale, weights, bias


def ridge_predict(model: tuple[torch.Tensor, ...], features: torch.Tensor) -> torch.Tensor:
    mean, scale, weights, bias = model
    return (((features.double() - mean) / scale) @ weights + bias).float()


def token_ev(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """The trainer's explained variance over a flat set of valid tokens (one process)."""
    from trl_sae.trainer.parts.metrics import explained_variance

    mask = torch.ones_like(targets, dtype=torch.bool)
    return explained_variance(_OneProcess(), predictions[None], targets[None], mask[None])


class _OneProcess:
    """The one collective ``explained_variance`` makes, on a single process: the sum over it is itself."""

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def choose_alpha(
    features: torch.Tensor, targets: torch.Tensor, rollout_of: torch.Tensor, n: int, group: int
) -> float:
    """The ridge strength of :data:`RIDGE_ALPHAS` with the best explained variance on the last quarter of the
    first ``n`` fitting rollouts' prompts (whole groups of ``group``), fitted on the rest of them."""
    prompts = n // group
    cut = group * (prompts - max(1, prompts // 4))
    train, valid = rollout_of < cut, (rollout_of >= cut) & (rollout_of < n)
    if cut == 0 or not valid.any():
        return RIDGE_ALPHAS[len(RIDGE_ALPHAS) // 2]
    scores = {
        alpha: token_ev(
            ridge_predict(ridge_fit(features[train], targets[train], alpha), features[valid]), targets[valid]
        )
        for alpha in RIDGE_ALPHAS
    }
    return max(scores, key=scores.get)


def cross_validated_ev(
    features: torch.Tensor, targets: torch.Tensor, rollout_of: torch.Tensor, group: int, folds: int = 4
) -> float:
    """Explained variance of ridge predictions over every token of the fitting rollouts, each predicted by a
    ridge fitted on the other folds (prompts interleaved into ``folds``; the strength chosen inside the
    training folds by :func:`choose_alpha`): with few successes, the held-out rollouts alone measure noisily."""
    fold_of = (rollout_of // group) % folds
    predictions = torch.empty_like(targets)
    for fold in range(folds):
        train, test = fold_of != fold, fold_of == fold
        kept = torch.unique(rollout_of[train])  # sorted: whole prompts, in order
        renumber = torch.full((int(rollout_of.max()) + 1,), -1, dtype=torch.long)
        renumber[kept] = torch.arange(len(kept))
        local = renumber[rollout_of[train]]
        alpha = choose_alpha(features[train], targets[train], local, len(kept), group)
        model = ridge_fit(features[train], targets[train], alpha)
        predictions[test] = ridge_predict(model, features[test])
    return token_ev(predictions, targets)


# --------------------------------------------------------------------------------------------------
# The trainer on the long task
# --------------------------------------------------------------------------------------------------
def gym_args(args: argparse.Namespace) -> argparse.Namespace:
    """real_model_gym's arguments for this task and seed (the held-out size is value pretraining's own)."""
    import real_model_gym as gym

    task = ["--long-task"]
    if getattr(args, "task_config", None) is not None:
        task = ["--task-config", json.dumps(args.task_config), "--worked-steps"]
    task += ["--response-length", str(args.response_length or gym.RESPONSE_LENGTH["long"])]
    if getattr(args, "lora_layers", None) is not None:
        task += ["--lora-layers", str(args.lora_layers)]
    return gym.parse_args([*task, "--seed", str(args.seed), "--eval-size", "16", "--threads", "1"])


def build_trainer(
    args: argparse.Namespace, output_dir: Path, critic: str, layer: int | None, lr: float, rollouts: int
) -> Any:
    """The SAEPPOTrainer of real_model_gym's long task (its LoRA policy, reward, prompts) with value
    pretraining on ``rollouts`` fitting completions and the given critic."""
    import real_model_gym as gym

    from trl_sae import SAEPPOConfig, SAEPPOTrainer

    g = gym_args(args)
    model, tokenizer = gym.load_model_and_tokenizer("base")
    train, _, _ = gym.datasets(g)
    config = SAEPPOConfig(
        output_dir=str(output_dir),
        advantage_estimator="sae",
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=BATCH // MICRO,
        local_rollout_forward_batch_size=MICRO,
        response_length=g.response_length,
        kl_coef=g.kl_coef,
        max_steps=1,
        num_mini_batches=FIT_MINI_BATCHES,
        critic_learning_rate=lr,
        loss_agg_mode="token-mean",
        stop_token="eos",
        value_head_layer=layer,
        value_head_trunk_grad_scale=0.0,
        value_pretrain_rollouts=rollouts,
        value_pretrain_held_out=args.held_out,
        value_pretrain_epochs=args.epochs,
        value_pretrain_patience=args.patience,
        value_pretrain_learning_rate=lr,
        overwrite_output_dir=True,
        **{**gym.shared_config(g), "disable_tqdm": False},  # the sampling and fitting bars: long stages
    )
    questions: list[list[str]] = []
    value_model = "head" if critic == "head" else None  # None with the LoRA config: the shared-base critic
    return gym.build_trainer(
        SAEPPOTrainer, config, g, model, tokenizer, train, questions, value_model=value_model
    )


def bank_file(args: argparse.Namespace) -> Path:
    return args.work_dir / f"seed-{args.seed}" / "bank" / "value_pretrain" / "rollouts" / "rank-0.pt"


def run_bank(args: argparse.Namespace) -> dict[str, Any]:
    from trl_sae.core.segmentation import get_segmenter_spec

    output_dir = bank_file(args).parents[2]
    trainer = build_trainer(args, output_dir, "head", None, 1e-3, args.rollouts)
    start = time.perf_counter()
    fit, held = trainer.value_pretraining().rollouts(resume=False)  # samples and saves rank-0.pt
    seconds = time.perf_counter() - start
    cfg = trainer.args
    stats = {}
    for name, batch in (("fit", fit), ("held_out", held)):
        boundaries = get_segmenter_spec(cfg.segmentation)(
            logprobs=batch.logprobs, entropies=batch.entropies, token_ids=batch.completion_ids,
            mask=batch.mask, newline_token_ids=None, segment_threshold=cfg.segment_threshold,
            segment_length=cfg.segment_length, entropy_threshold=cfg.entropy_threshold,
        )  # fmt: skip
        stats[name] = bank_statistics(batch.scores, batch.mask, boundaries, cfg.num_generations)
        stats[name]["mean_prompt_tokens"] = float(batch.prompt_mask.float().sum(dim=1).mean())
        stats[name]["truncated"] = float(batch.is_truncated.float().mean())
    total = args.rollouts + args.held_out
    return {
        "stage": "bank",
        "seed": args.seed,
        "task_config": gym_args(args).task_config,
        "response_length": cfg.response_length,
        "rollouts": args.rollouts,
        "held_out": args.held_out,
        "segmentation": cfg.segmentation,
        "segment_threshold": cfg.segment_threshold,
        "sampling_seconds": round(seconds, 1),
        "rollouts_per_second": round(total / seconds, 3),
        "statistics": stats,
        "bank": str(bank_file(args)),
    }


def common_prefix(sequences: list[list[int]]) -> int:
    """Length of the longest prefix every sequence shares."""
    shortest = min(len(seq) for seq in sequences)
    for index in range(shortest):
        if any(seq[index] != sequences[0][index] for seq in sequences):
            return index
    return shortest


@torch.no_grad()
def layer_states(
    model: Any, part: dict[str, torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per decoder layer of ``model``, the ``(tokens, D)`` states before each valid completion token of the
    rollouts ``part`` (the final norm's output for the last layer, RMS-normalised for the others, as the head
    critic reads them), each token's return and the index of its rollout.

    The prompts' common prefix (the system prompt and few-shot examples: ~190 of ~220 tokens on the long task)
    runs once and its key-value cache is reused for every rollout; each rollout's own prompt tail and completion
    follow, unpadded at the front (causal attention: a valid token never sees the padding behind it)."""
    import copy

    from trl_sae.trainer.critics.head import rms_normalise

    model.eval()
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(part["prompt_ids"], part["prompt_mask"])]
    lengths = part["completion_mask"].sum(dim=1).tolist()
    completions = [ids[:n].tolist() for ids, n in zip(part["completion_ids"], lengths)]
    shared = min(
        common_prefix(prompts), min(len(p) for p in prompts) - 1
    )  # >= 1 token of each prompt after it
    cache = None
    if shared > 0:
        cache = model(input_ids=torch.tensor([prompts[0][:shared]]), use_cache=True).past_key_values
    per_layer: list[list[torch.Tensor]] = []
    for start in range(0, len(prompts), MICRO):
        rows = range(start, min(start + MICRO, len(prompts)))
        tails = [prompts[i][shared:] + completions[i] for i in rows]
        width = max(len(tail) for tail in tails)
        input_ids = torch.zeros(len(tails), width, dtype=torch.long)
        tail_mask = torch.zeros(len(tails), width, dtype=torch.long)
        for row, tail in enumerate(tails):
            input_ids[row, : len(tail)] = torch.tensor(tail)
            tail_mask[row, : len(tail)] = 1
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.cat([torch.ones(len(tails), shared, dtype=torch.long), tail_mask], dim=1),
            "position_ids": (shared + torch.arange(width)).expand(len(tails), width),
        }
        if cache is not None:
            batch_cache = copy.deepcopy(cache)
            batch_cache.batch_repeat_interleave(len(tails))
            inputs["past_key_values"] = batch_cache
        hidden = model(**inputs, output_hidden_states=True, use_cache=cache is not None).hidden_states[1:]
        # the state before completion token t of row r sits at (its prompt tail's length - 1 + t)
        index_rows = torch.cat([torch.full((lengths[i],), row) for row, i in enumerate(rows)])
        index_cols = torch.cat([len(prompts[i]) - shared - 1 + torch.arange(lengths[i]) for i in rows])
        if not per_layer:
            per_layer = [[] for _ in hidden]
        for index, states in enumerate(hidden):
            states = states[index_rows, index_cols].float()
            if index < len(hidden) - 1:
                states = rms_normalise(states)
            per_layer[index].append(states)
    mask = part["completion_mask"].bool()
    rollout_of = torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask]
    return [torch.cat(p) for p in per_layer], part["returns"][mask].float(), rollout_of


def probe_layers(
    fit: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor],
    held: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor],
    sizes: list[int],
    group: int,
) -> list[dict[str, Any]]:
    """Per layer and fitting size n: the ridge strength chosen on the first n fitting rollouts and the
    held-out explained variance of the ridge fitted on them (:func:`layer_states`' outputs in)."""
    (fit_states, fit_returns, fit_rollout), (held_states, held_returns, _) = fit, held
    layers = []
    for layer, (x, x_held) in enumerate(zip(fit_states, held_states)):
        row: dict[str, Any] = {"layer": layer, "ev": {}, "alpha": {}}
        for n in sizes:
            alpha = choose_alpha(x, fit_returns, fit_rollout, n, group)
            use = fit_rollout < n
            model = ridge_fit(x[use], fit_returns[use], alpha)
            row["ev"][str(n)] = token_ev(ridge_predict(model, x_held), held_returns)
            row["alpha"][str(n)] = alpha
        row["cv_ev"] = cross_validated_ev(x, fit_returns, fit_rollout, group)
        layers.append(row)
        print(json.dumps({"layer": layer, "ev": row["ev"], "cv_ev": row["cv_ev"]}), flush=True)
    return layers


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    saved = torch.load(bank_file(args), map_location="cpu", weights_only=True)
    fit = {k[4:]: v for k, v in saved.items() if k.startswith("fit/")}
    held = {k[5:]: v for k, v in saved.items() if k.startswith("held/")}
    import real_model_gym as gym

    start = time.perf_counter()
    model, _ = gym.load_model_and_tokenizer("base")
    fit_part, held_part = layer_states(model, fit), layer_states(model, held)
    del model
    forward_seconds = time.perf_counter() - start
    layers = probe_layers(fit_part, held_part, args.sizes, gym_args(args).num_generations)
    held_returns = held_part[1]
    return {
        "stage": "probe",
        "seed": args.seed,
        "sizes": args.sizes,
        "held_out_tokens": int(held_returns.numel()),
        "held_out_return_variance": float(held_returns.var(unbiased=False)),
        "forward_seconds": round(forward_seconds, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "layers": layers,
        "note": "layers are decoder layers (0-based); the last is the final norm's output, the others "
        "RMS-normalised, as the head critic reads them",
    }


def truncate_bank(saved: dict[str, torch.Tensor], rollouts: int) -> dict[str, torch.Tensor]:
    """The saved bank with only its first ``rollouts`` fitting rollouts (the held-out ones all kept)."""
    return {k: v[:rollouts] if k.startswith("fit/") and v.dim() > 0 else v for k, v in saved.items()}


def fit_label(args: argparse.Namespace, name: str) -> str:
    """A fit's name in its file and folder: the critic, the fitting rollouts and the LoRA when not every layer."""
    lora = f"-lora{args.lora_layers}" if getattr(args, "lora_layers", None) is not None else ""
    return f"{name}-n{args.fit_rollouts}{lora}"


def fit_folder(args: argparse.Namespace, name: str) -> Path:
    """The fit's output folder; its ``value_pretrain/`` is a ``value_pretrain_path`` for PPO runs."""
    return args.work_dir / f"seed-{args.seed}" / f"fit-{fit_label(args, name)}"


def interrupted_epochs(output_dir: Path) -> list[int]:
    """The epochs an unfinished value pretraining in ``output_dir`` saved (none when it finished or never ran)."""
    from trl_sae.trainer.parts.value_pretrain import PROGRESS_PREFIX, SUMMARY_FILE

    folder = output_dir / "value_pretrain"
    if (folder / SUMMARY_FILE).is_file():
        return []
    saved = [p for p in folder.glob(f"{PROGRESS_PREFIX}*") if (p / "progress.json").is_file()]
    return sorted(int(p.name[len(PROGRESS_PREFIX) :]) for p in saved)


def run_fit(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The trainer's value pretraining of critic ``name`` on a copy of the bank (resumed: no sampling)."""
    from trl_sae.trainer.parts.value_pretrain import _as_batch

    critic, layer, lr = parse_fit(name)
    output_dir = fit_folder(args, name)
    interrupted = interrupted_epochs(output_dir)
    if interrupted:
        # An earlier process stopped mid-fit: the trainer continues from its newest epoch (it refuses other
        # settings), so a fit of ~1 h can span sittings.
        print(f"fit {name}: continuing after epoch {max(interrupted)} from {output_dir}", flush=True)
    else:
        shutil.rmtree(output_dir, ignore_errors=True)
    trainer = build_trainer(args, output_dir, critic, layer, lr, args.fit_rollouts)
    vp = trainer.value_pretraining()
    saved = truncate_bank(
        torch.load(bank_file(args), map_location="cpu", weights_only=True), args.fit_rollouts
    )
    # Epoch 0 (the critic as built) is measured from the rollouts' own values: this critic's, not the
    # bank's head critic's.
    held = _as_batch({k[5:]: v for k, v in saved.items() if k.startswith("held/")}, torch.device("cpu"))
    saved["held/values"] = vp.held_out_values(held)
    target = output_dir / "value_pretrain" / "rollouts" / "rank-0.pt"
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, target)
    start = time.perf_counter()
    summary = vp.run(resume=True)
    seconds = time.perf_counter() - start
    epochs = summary["epochs_run"]
    return {
        "stage": "fit",
        "seed": args.seed,
        "critic": name,
        "value_model": critic,
        "value_head_layer": layer,
        "learning_rate": lr,
        "rollouts": args.fit_rollouts,
        "held_out": args.held_out,
        "lora_layers": args.lora_layers,
        "value_pretrain_path": str(output_dir / "value_pretrain"),
        "optimizer_steps_per_epoch": args.fit_rollouts // (BATCH // FIT_MINI_BATCHES),
        "epochs_cap": args.epochs,
        "patience": args.patience,
        "explained_variance_held_out": summary["explained_variance_held_out"],
        "r2_held_out": summary.get("r2_held_out"),
        "loss": summary["loss"],
        "best_epoch": summary["best_epoch"],
        "fitting_seconds": round(summary["seconds"]["fitting"], 1),
        "seconds_per_epoch": round(summary["seconds"]["fitting"] / max(epochs, 1), 1),
        "seconds": round(seconds, 1),
    }


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def report(results: list[dict[str, Any]]) -> str:
    """``results.md`` from the stages' JSONs."""
    lines = ["# Value pretraining curve (issue 50 item 2)", ""]
    lines += ["Generated by `benchmarks/value_pretrain_curve.py --report` from the JSONs here.", ""]
    for bank in (r for r in results if r["stage"] == "bank"):
        lines += [f"## Bank, seed {bank['seed']}", ""]
        lines += [
            f"{bank['rollouts']} fitting + {bank['held_out']} held-out completions sampled in "
            f"{bank['sampling_seconds']:.0f} s ({bank['rollouts_per_second']:.2f} rollouts/s); boundaries: "
            f"{bank['segmentation']} segmenter at {bank['segment_threshold']}. Task: "
            f"{task_text(bank.get('task_config'))}, worked-step examples, "
            f"{bank.get('response_length', 128)} completion tokens.",
            "",
            "| part | completions | prompts | pass rate | mixed prompts | mean completion tokens | truncated | "
            "boundaries per completion | between-prompt share of the score variance |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for part, s in bank["statistics"].items():
            share = s.get("between_prompt_share")  # banks written before it was measured have none
            lines.append(
                f"| {part} | {s['completions']} | {s['prompts']} | {s['pass_rate']:.3f} | {s['mixed_prompts']:.3f} | "
                f"{s['mean_completion_tokens']:.1f} | {s['truncated']:.3f} | {s['mean_boundaries']:.2f} | "
                f"{'not measured' if share is None else f'{share:.3f}'} |"
            )
        lines.append("")
    for probe in (r for r in results if r["stage"] == "probe"):
        sizes = [str(n) for n in probe["sizes"]]
        lines += [f"## Probe (ridge on frozen states), seed {probe['seed']}", ""]
        lines += [
            f"Held-out explained variance over {probe['held_out_tokens']} completion tokens (return variance "
            f"{probe['held_out_return_variance']:.4f}), by decoder layer and fitting rollouts n; forward pass "
            f"{probe['forward_seconds']:.0f} s, all {probe['seconds']:.0f} s.",
            "",
            "The last column: explained variance over all the fitting rollouts' tokens, each predicted by a ridge "
            "fitted on the other three quarters of the prompts (4-fold cross-validation).",
            "",
            "| layer | " + " | ".join(f"n={n}" for n in sizes) + " | 4-fold CV on the fitting rollouts |",
            "|---|" + "---|" * (len(sizes) + 1),
        ]
        best = max(probe["layers"], key=lambda row: row["ev"][sizes[-1]])
        for row in probe["layers"]:
            mark = " (best)" if row is best else ""
            lines.append(
                f"| {row['layer']}{mark} | "
                + " | ".join(f"{row['ev'][n]:.3f}" for n in sizes)
                + (f" | {row['cv_ev']:.3f} |" if "cv_ev" in row else " | - |")
            )
        lines.append("")
    fits = [r for r in results if r["stage"] == "fit"]
    if fits:
        lines += ["## Fits (the trainer's value pretraining on the bank)", ""]
        lines += [
            "| seed | critic | layer | lr | rollouts | EV per epoch (0 = as built) | R^2 per epoch | best epoch "
            "| s / epoch |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for f in fits:
            evs = ", ".join(f"{v:.3f}" for v in f["explained_variance_held_out"])
            # fits from before the trainer kept epochs by held-out R^2 recorded none (best epoch then: by EV)
            r2s = ", ".join(f"{v:.3f}" for v in f["r2_held_out"]) if f.get("r2_held_out") else "not recorded"
            layer = "last" if f["value_head_layer"] is None else f["value_head_layer"]
            if f["value_model"] == "shared":
                lora = f.get("lora_layers")  # absent or None: LoRA on every layer
                layer = "LoRA trunk, every layer" if lora is None else f"LoRA trunk, last {lora} layers"
            lines.append(
                f"| {f['seed']} | {f['critic']} | {layer} | {f['learning_rate']:g} | {f['rollouts']} | {evs} | "
                f"{r2s} | {f['best_epoch']} | {f['seconds_per_epoch']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def task_text(task_config: dict[str, Any] | None) -> str:
    """A bank's task for the report: its basic_arithmetic settings, or the long task (banks from before
    ``--task-config`` recorded none)."""
    if task_config is None:
        return "the long task (real_model_gym.py --long-task)"
    return f"basic_arithmetic `{json.dumps(task_config)}`"


def write_report(output_dir: Path) -> Path:
    results = [json.loads(p.read_text()) for p in sorted(output_dir.glob("*.json"))]
    path = output_dir / "results.md"
    path.write_text(report(results))
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(write_report(args.output_dir))
        return 0
    from _common import Job, code_at_start, environment, run_jobs

    code_at_start()
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    seed = args.seed

    def stamped(run: Any) -> Any:  # each JSON names the code and machine state it ran with
        return lambda: {**run(), "code": code_at_start(), "environment": environment()}

    jobs = [
        Job(f"bank seed {seed}", args.output_dir / f"bank-seed{seed}.json", stamped(lambda: run_bank(args)))
    ]
    if not args.no_probe:
        path = args.output_dir / f"probe-seed{seed}.json"
        jobs.append(Job(f"probe seed {seed}", path, stamped(lambda: run_probe(args))))
    for name in args.fits:
        path = args.output_dir / f"fit-seed{seed}-{fit_label(args, name)}.json"
        jobs.append(Job(f"fit seed {seed} {name}", path, stamped(lambda name=name: run_fit(args, name))))
    run_jobs(jobs, commit=args.commit)
    print(write_report(args.output_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
