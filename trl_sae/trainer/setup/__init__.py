"""What :class:`~trl_sae.SAEPPOTrainer` builds before its first step: the policy, tokenizer and reference
(:mod:`.models`), PEFT plumbing and LoRA merging (:mod:`.adapters`), the Accelerator with FSDP and DeepSpeed
(:mod:`.distributed`), the prompt datasets (:mod:`.prompts`), the optimizer's parameter groups
(:mod:`.optimizer`), mixed-precision numerics (:mod:`.precision`) and vLLM rollouts (:mod:`.vllm`)."""

# A namespace for its modules: import names from them (the modules above), so none is exported twice.
__all__: list[str] = []
