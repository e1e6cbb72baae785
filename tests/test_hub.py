"""Model cards and Hub pushes, offline: card content, files written, and the arguments of the push calls."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import yaml
from peft import LoraConfig

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.hub import estimator_settings, final_metrics, model_card, save_and_push

from .test_trainer import make_config, make_dataset, vowel_fraction

LOG_HISTORY = [
    {"step": 1, "reward/mean": 0.25, "critic/explained_variance": float("nan"), "loss/value": 0.3},
    {"step": 2, "reward/mean": 0.5, "segments/mean_length": 7.5, "critic/explained_variance": 0.4},
]


def card_metadata(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.fixture
def fake_hub(monkeypatch):
    """Record create_repo / upload_folder calls instead of reaching the Hub."""
    calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        calls.append(("upload_folder", kwargs))
        return f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return calls


def test_card_states_the_estimator_its_settings_and_final_metrics(tmp_path):
    args = SAEPPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        segment_threshold=0.3,
        lam=0.9,
        critic_lam=1.0,
        num_generations=4,
        per_device_train_batch_size=8,
        learning_rate=2e-6,
        critic_learning_rate=3e-5,
    )
    card = model_card(
        args,
        LOG_HISTORY,
        repo_id="me/qwen3-sae",
        base_model="Qwen/Qwen3-0.6B",
        dataset_name="BytedTsinghua-SIA/DAPO-Math-17k",
        extra_metrics={"eval/accuracy": 0.42},
    )
    meta = card_metadata(card)
    assert meta["library_name"] == "transformers"
    assert meta["base_model"] == "Qwen/Qwen3-0.6B"
    assert meta["datasets"] == ["BytedTsinghua-SIA/DAPO-Math-17k"]
    assert {"trl", "trl-sae", "sae"} <= set(meta["tags"])
    for row in (
        "| `advantage_estimator` | sae |",
        "| `segmentation` | probability |",
        "| `segment_threshold` | 0.3 |",
        "| `lam` | 0.9 |",
        "| `critic_lam` | 1 |",
        "| `num_generations` | 4 |",
        "| `learning_rate` | 2e-06 |",
        "| `critic_learning_rate` | 3e-05 |",
        # last logged values; NaN is skipped in favour of the last finite one
        "| `reward/mean` | 0.5 |",
        "| `segments/mean_length` | 7.5 |",
        "| `critic/explained_variance` | 0.4 |",
        "| `eval/accuracy` | 0.42 |",
    ):
        assert row in card, row
    assert "segment_length" not in card  # uniform segmentation only
    assert 'AutoModelForCausalLM.from_pretrained("me/qwen3-sae")' in card
    assert "last logged step: 2" in card


def test_card_lists_only_the_knobs_the_estimator_reads(tmp_path):
    grpo = estimator_settings(
        SAEPPOConfig(output_dir=str(tmp_path), use_cpu=True, advantage_estimator="grpo", num_generations=2)
    )
    assert grpo["estimator"]["grpo_scale"] == "std"
    assert not {"lam", "critic_lam", "segment_threshold"} & set(grpo["estimator"])
    assert "critic_learning_rate" not in grpo["optimisation"]
    adaptive = estimator_settings({"advantage_estimator": "adaptive_lambda", "segmentation": "probability"})
    assert "adaptive_lambda_alpha" in adaptive["estimator"] and "lam" not in adaptive["estimator"]
    uniform = estimator_settings(
        {"advantage_estimator": "sae", "segmentation": "uniform", "segment_length": 64}
    )
    assert uniform["estimator"]["segment_length"] == 64 and "segment_threshold" not in uniform["estimator"]


def test_adapter_card_explains_loading_on_the_base(tmp_path):
    card = model_card(
        {"advantage_estimator": "sae", "segmentation": "probability"},
        repo_id="me/lora",
        base_model="Qwen/Qwen3-0.6B",
        adapter_only=True,
    )
    assert card_metadata(card)["library_name"] == "peft"
    assert 'PeftModel.from_pretrained(base, "me/lora")' in card
    # a local path is not valid Hub metadata
    local = model_card({"advantage_estimator": "gae"}, base_model=str(tmp_path))
    assert "base_model" not in card_metadata(local)


def test_final_metrics_takes_the_last_finite_value():
    assert final_metrics(LOG_HISTORY, ["reward/mean", "critic/explained_variance", "missing"]) == {
        "reward/mean": 0.5,
        "critic/explained_variance": 0.4,
    }


def make_trainer(tmp_path, tokenizer, peft_config=None, **overrides):
    return SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, max_steps=1, **overrides),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def test_save_and_push_writes_the_model_card_and_uploads_the_folder(tmp_path, tokenizer, fake_hub):
    trainer = make_trainer(
        tmp_path, tokenizer, push_to_hub=False, hub_model_id="me/tiny-sae", hub_private_repo=True
    )
    trainer.train()
    out = tmp_path / "final"
    saved = save_and_push(trainer, out, push=True, base_model="Qwen/Qwen3-0.6B", extra_metrics={"eval": 1.0})
    assert saved["pushed"] and not saved["adapter_only"]
    assert saved["url"] == "https://huggingface.co/me/tiny-sae/commit/abc"
    files = {p.name for p in out.iterdir()}
    assert {"README.md", "config.json", "model.safetensors", "trl_sae_config.json", "value_model"} <= files
    card = (out / "README.md").read_text()
    assert "| `reward/mean` |" in card and "| `advantage_estimator` | sae |" in card
    config = json.loads((out / "trl_sae_config.json").read_text())
    assert config["advantage_estimator"] == "sae" and config["hub_token"] != "secret"
    (create, create_kwargs), (upload, upload_kwargs) = fake_hub
    assert create == "create_repo" and create_kwargs["repo_id"] == "me/tiny-sae"
    assert create_kwargs["private"] is True and create_kwargs["exist_ok"] is True
    assert upload == "upload_folder"
    assert upload_kwargs["repo_id"] == "me/tiny-sae"
    assert upload_kwargs["folder_path"] == str(out)
    assert "checkpoint-*" in upload_kwargs["ignore_patterns"]


def test_lora_saves_adapter_only_or_merged(tmp_path, tokenizer, fake_hub):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    adapter = make_trainer(tmp_path / "a", tokenizer, peft_config=lora)
    saved = save_and_push(adapter, tmp_path / "adapter", push=False, base_model="Qwen/Qwen3-0.6B")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert saved["adapter_only"] and "adapter_config.json" in files and "model.safetensors" not in files
    assert card_metadata((tmp_path / "adapter" / "README.md").read_text())["library_name"] == "peft"

    merged = make_trainer(tmp_path / "m", tokenizer, peft_config=lora, merge_adapters=True)
    saved = save_and_push(merged, tmp_path / "merged", push=False)
    files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert not saved["adapter_only"] and {"config.json", "model.safetensors"} <= files
    assert "adapter_config.json" not in files
    assert fake_hub == []  # push=False never touches the Hub


def test_push_needs_a_repo_id(tmp_path, tokenizer, fake_hub):
    trainer = make_trainer(tmp_path, tokenizer)
    with pytest.raises(ValueError, match="hub_model_id"):
        save_and_push(trainer, tmp_path / "x", push=True)
    assert fake_hub == []
