"""The offline demo: a synthetic multi-step arithmetic task, the long-horizon decision task, tiny Qwen3 models
built locally, an SFT warm start, the demo run and its HTML report. Library modules never import from here."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CODE_TASK_FAMILIES": ".code_tasks",  # trl_sae.code_tasks: recipes use it, so it sits below demo
    "make_code_task_dataset": ".code_tasks",
    "DECISION_DEFAULTS": "decision_task",
    "FILLER_TEXT": "decision_task",
    "TAG_DIGITS": "decision_task",
    "DecisionDefaults": "decision_task",
    "boundary_precision_recall": "decision_task",
    "decision_char_positions": "decision_task",
    "decision_segmentation": "decision_task",
    "decision_token_positions": "decision_task",
    "filler": "decision_task",
    "format_walk": "decision_task",
    "format_walk_prompt": "decision_task",
    "make_walk_dataset": "decision_task",
    "make_walk_splits": "decision_task",
    "prepare_walk_demo": "decision_task",
    "walk_length": "decision_task",
    "walk_reward": "decision_task",
    "make_completion_record": "report",
    "render_curves_png": "report",
    "render_segments_html": "report",
    "render_segments_terminal": "report",
    "split_segments": "report",
    "write_html_report": "report",
    "DemoConfig": "run",
    "TASKS": "run",
    "run_demo": "run",
    "ANSWER_PREFIX": "tasks",
    "DEMO_DEFAULTS": "tasks",
    "DemoDefaults": "tasks",
    "TASK_VARIANTS": "tasks",
    "completion_text": "tasks",
    "extract_answer": "tasks",
    "format_prompt": "tasks",
    "format_solution": "tasks",
    "make_running_sum_dataset": "tasks",
    "make_running_sum_splits": "tasks",
    "running_sum_reward": "tasks",
    "CHAT_TEMPLATE": "tiny",
    "build_char_tokenizer": "tiny",
    "build_tiny_qwen3": "tiny",
    "build_tiny_qwen3_critic": "tiny",
    "DemoSetup": "warmstart",
    "prepare_demo": "warmstart",
    "sft_loss": "warmstart",
    "sft_warm_start": "warmstart",
    "warm_start_on_splits": "warmstart",
    "tokenize_sft_examples": "warmstart",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
