"""Parameter fingerprints of fixed tiny training runs, for refactors that must not change behaviour.

Run it before and after a change; the outputs must be identical line for line (one line per set-up: a
separate, head and shared-base LoRA critic, LoRA with the head critic, every estimator family, SAE with
uniform segments, value warm-up, the RLVR knobs). Each line is a SHA-256 prefix over every parameter of the
trained model after two or three PPO steps of a tiny Qwen3 on CPU (seed 0), so any change to what a step
computes shows. The trainer/ restructure of issue 49 was checked with it: identical before and after.

    python benchmarks/refactor_fingerprint.py --out before.txt     # on the old tree
    python benchmarks/refactor_fingerprint.py --out after.txt      # on the new tree
    diff before.txt after.txt && echo identical
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import warnings
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}

# name -> (config overrides, trainer keyword arguments)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "separate-sae": ({}, {}),
    "separate-gae": ({"advantage_estimator": "gae"}, {}),
    "grpo": ({"advantage_estimator": "grpo"}, {}),
    "sae-uniform": ({"segmentation": "uniform", "segment_length": 3}, {}),
    "mc-warmup": ({"advantage_estimator": "mc", "value_warmup_steps": 1, "max_steps": 3}, {}),
    "head": ({}, {"value_model": "head"}),
    "lora-shared": ({}, {"lora": True}),
    "lora-head": ({}, {"value_model": "head", "lora": True}),
    "rlvr": (
        {
            "loss_agg_mode": "token-mean",
            "cliprange_high": 0.28,
            "top_entropy_quantile": 0.5,
            "overlong_buffer_length": 2,
        },
        {},
    ),
}


def vowel_fraction(
    prompts: list[Any], completions: list[str], completion_ids: Any, **columns: Any
) -> list[float]:
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]


def fingerprint(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, parameter in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def run_case(name: str, tokenizer: Any, folder: str) -> str:
    overrides, trainer_kwargs = CASES[name]
    settings = dict(
        output_dir=os.path.join(folder, name),
        per_device_train_batch_size=8,
        num_generations=4,
        response_length=8,
        max_steps=2,
        learning_rate=3e-3,
        critic_learning_rate=3e-3,
        temperature=1.0,
        report_to="none",
        logging_strategy="no",  # the printed logs hold timings; stdout is the fingerprints only
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        stop_token=None,
    )
    settings.update(overrides)
    kwargs = dict(trainer_kwargs)
    peft_config = LoraConfig(**LORA) if kwargs.pop("lora", False) else None
    torch.manual_seed(0)
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=SAEPPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": [f"Say vowels {i}:" for i in range(16)]}),
        processing_class=tokenizer,
        peft_config=peft_config,
        **kwargs,
    )
    trainer.train()
    return fingerprint(trainer.accelerator.unwrap_model(trainer.model))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"set-ups to run (default: all): {', '.join(CASES)}")
    parser.add_argument("--out", help="write the fingerprints here (libraries also print to stdout)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"unknown set-up {unknown[0]!r}; choose from {', '.join(CASES)}")
    warnings.filterwarnings("ignore")
    tokenizer = build_char_tokenizer()
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.cases or CASES:
            lines.append(f"{name} {run_case(name, tokenizer, folder)}")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
