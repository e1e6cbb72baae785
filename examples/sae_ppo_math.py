"""PPO with Segmental Advantage Estimation on math problems, from a YAML recipe.

Single GPU (QLoRA, 16 GB):

    accelerate launch --config_file examples/accelerate_configs/single_gpu.yaml \\
        examples/sae_ppo_math.py --config examples/qwen3_0.6b_qlora.yaml

Several GPUs (DDP), or the paper's setup with DeepSpeed ZeRO-3:

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml \\
        examples/sae_ppo_math.py --config examples/qwen3_4b_lora.yaml
    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml \\
        examples/sae_ppo_math.py --config examples/paper_qwen3_8b_base.yaml

Any recipe key can be overridden after the recipe (``--max_steps 50 --advantage_estimator gae``);
``--dry_run`` builds everything and stops before training; ``--push_to_hub --hub_model_id me/model``
uploads the result with a model card; ``--resume_from_checkpoint true`` continues from the newest intact
checkpoint in output_dir. ``trl-sae train RECIPE.yaml`` runs the same code.
"""

from __future__ import annotations

import sys

from trl_sae.hub import final_metrics, save_and_push
from trl_sae.recipe import build_trainer, end_distributed_run, parse_recipe


def main(argv: list[str] | None = None) -> dict:
    # 1. The recipe: ScriptArguments (model, data, rewards, LoRA) + SAEPPOConfig (the trainer's settings).
    script_args, training_args = parse_recipe(argv, prog="sae_ppo_math.py", description=__doc__)

    # 2. Pushing happens once, after training, with the SAE model card (see step 5); the trainer itself
    #    must not create the Hub repo at construction.
    push = training_args.push_to_hub
    training_args.push_to_hub = False

    # 3. Tokenizer, prompt datasets (prompt + answer columns), reward functions, LoRA config, trainer.
    trainer, train_dataset, eval_dataset = build_trainer(script_args, training_args)
    if script_args.dry_run:
        print(f"dry run: trainer built for {len(train_dataset)} prompts; not training.")
        return {"dry_run": True}

    # 4. Train: rollout -> rewards -> values -> boundaries -> advantages -> PPO update, every step.
    #    --resume_from_checkpoint takes a checkpoint folder, or true for the newest intact one in output_dir.
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = trainer.evaluate() if eval_dataset is not None else {}

    # 5. Save (merged or adapter-only, per merge_adapters), write the model card, push if asked.
    saved = save_and_push(
        trainer,
        push=push,
        repo_id=training_args.hub_model_id,
        base_model=script_args.model_name_or_path,
        dataset_name=script_args.dataset_name,
        extra_metrics=metrics,
    )
    if trainer.accelerator.is_main_process:
        print({**final_metrics(trainer.state.log_history), **metrics, **saved})
    # 6. Several processes: tear the process group down while every rank is still alive (a gloo rank that
    #    exits with it up can abort at interpreter exit: pytorch/pytorch#190489).
    end_distributed_run(trainer)
    return saved


if __name__ == "__main__":
    main(sys.argv[1:])
