"""Issue 9's input cases: every setting does what it says and bad input fails early, in one line.

Count options reject 0 and negatives; dropout is off however a model applies it; every EOS the model
declares stops generation without changing its saved generation config; over-long prompts are filtered
(or truncated / refused) loudly; recipe mistakes are one line; a missing model is "no such directory" at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from datasets import Dataset
from transformers import GenerationConfig, OPTConfig, OPTForCausalLM

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.cli.app import main
from trl_sae.demo.tiny import build_tiny_qwen3

RECIPE = str(Path(__file__).resolve().parents[1] / "examples" / "qwen3_1.7b_lora.yaml")


def vowel_fraction(prompts, completions, completion_ids, **columns):
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]


def config(tmp_path, **overrides) -> SAEPPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        response_length=8,
        max_steps=1,
        learning_rate=3e-3,
        critic_learning_rate=3e-3,
        temperature=1.0,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        stop_token=None,
    )
    settings.update(overrides)
    return SAEPPOConfig(**settings)


def prompts(n: int = 16, chat: bool = False, text: str = "Say vowels {i}:") -> Dataset:
    rows = [text.format(i=i) for i in range(n)]
    if chat:
        rows = [[{"role": "user", "content": p}] for p in rows]
    return Dataset.from_dict({"prompt": rows})


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------------------------------
# Count options of the CLI
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--steps", "0"],
        ["demo", "--quick", "--steps", "-3"],
        ["demo", "--threads", "0"],
        ["eval", "--model", "m", "-k", "0"],
        ["eval", "--model", "m", "--limit", "-1"],
        ["segstats", "--model", "m", "--task", "running-sum", "--max-new-tokens", "0"],
        ["correlate", "--model", "m", "--task", "running-sum", "--num-trajectories", "0"],
    ],
)
def test_count_options_reject_zero_and_negatives(capsys, monkeypatch, argv):
    called = []
    for name in ("demo.cmd_demo", "eval.cmd_eval", "segstats.cmd_segstats", "correlate.cmd_correlate"):
        monkeypatch.setattr(f"trl_sae.cli.{name}", lambda args: called.append(args) or 0)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and not called
    assert f"argument {argv[-2]}" in err and f"must be >= 1, got {int(argv[-1])}" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "-p", "2"],
        ["demo", "-p", "nan"],
        ["demo", "-p", "0"],
        ["demo", "--task", "decision", "--segment-threshold", "1"],
        ["segments", "--model", "m", "--text", "x", "-p", "-0.5"],
    ],
)
def test_probability_options_reject_values_outside_0_1_while_parsing(capsys, monkeypatch, argv):
    called = []
    for name in ("demo.cmd_demo", "segments.cmd_segments"):
        monkeypatch.setattr(f"trl_sae.cli.{name}", lambda args: called.append(args) or 0)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    # Before: accepted here, and `demo -p 2` failed only after the minutes-long SFT warm start.
    assert exit_info.value.code == 2 and not called
    assert f"argument {argv[-2]}" in err or "argument -p/--segment-threshold" in err
    assert f"must be in (0, 1), got {argv[-1]}" in err


@pytest.fixture
def no_warm_start(monkeypatch):
    """Any demo argument error must come before the warm start: reaching it fails the test."""

    def warm_start(*args, **kwargs):
        raise AssertionError("the SFT warm start ran before the demo's arguments were checked")

    monkeypatch.setattr("trl_sae.demo.warmstart.prepare_demo", warm_start)
    monkeypatch.setattr("trl_sae.demo.decision_task.prepare_walk_demo", warm_start)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"segment_threshold": 2.0}, r"run_demo: segment_threshold \(SAE's p\) must be in \(0, 1\), got 2.0"),
        ({"segment_threshold": float("nan")}, r"segment_threshold \(SAE's p\) must be in \(0, 1\), got nan"),
        ({"segment_threshold": 0.0, "task": "decision"}, r"must be in \(0, 1\), got 0.0"),
        ({"threads": 0}, r"run_demo: threads must be >= 1"),
        # Settings only SAEPPOConfig knows are checked before the warm start too.
        (
            {"estimator": "no-such-estimator"},
            r"SAEPPOConfig\.advantage_estimator: 'no-such-estimator' is unknown",
        ),
        ({"seed": -1}, r"SAEPPOConfig\.seed: must be >= 0, got -1"),
    ],
)
def test_run_demo_checks_every_argument_before_the_warm_start(tmp_path, no_warm_start, kwargs, message):
    from trl_sae.demo.run import run_demo

    with pytest.raises(ValueError, match=message):
        run_demo(output_dir=tmp_path / "demo", quick=True, progress=False, verbose=False, **kwargs)
    assert not (tmp_path / "demo").exists()  # nothing written either


def test_run_demo_without_vllm_installed_fails_before_the_warm_start(tmp_path, no_warm_start, monkeypatch):
    from trl_sae.demo.run import run_demo

    monkeypatch.setattr("trl_sae.generation.vllm_backend.is_vllm_available", lambda: False)
    with pytest.raises(ImportError, match=r"run_demo: use_vllm=True needs vLLM"):
        run_demo(output_dir=tmp_path / "demo", quick=True, progress=False, verbose=False, use_vllm=True)


def test_run_demo_rejects_nonpositive_steps(tmp_path):
    from trl_sae.demo.run import run_demo

    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_demo(output_dir=tmp_path, steps=0, quick=True, progress=False, verbose=False)


# --------------------------------------------------------------------------------------------------
# Dropout applied functionally (OPT)
# --------------------------------------------------------------------------------------------------
def tiny_opt(tokenizer) -> OPTForCausalLM:
    torch.manual_seed(0)
    opt_config = OPTConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        dropout=0.3,
        attention_dropout=0.3,
        activation_dropout=0.3,
        layerdrop=0.0,
    )
    return OPTForCausalLM(opt_config)


def test_functional_dropout_is_off_so_the_first_ppo_ratio_is_one(tmp_path, tokenizer):
    # OPT calls F.dropout(p=self.dropout) with floats copied from its config: no nn.Dropout to zero.
    trainer = SAEPPOTrainer(
        model=tiny_opt(tokenizer),
        reward_funcs=vowel_fraction,
        args=config(tmp_path, num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.05),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    metrics = trainer.train_step(0)
    # One mini-batch, one epoch: the update sees the rollout's own policy, so the ratio is exactly 1
    # up to float noise (it was 2e-4 .. 2e-3 with dropout on).
    assert metrics["policy/approx_kl"] < 1e-6
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    for model in (unwrapped.policy, unwrapped.critic, trainer.ref_model):
        assert model.config.dropout == model.config.attention_dropout == model.config.activation_dropout == 0
        layer = model.model.decoder.layers[0]
        assert layer.dropout == layer.self_attn.dropout == 0


# --------------------------------------------------------------------------------------------------
# Every EOS the model declares stops generation; the saved generation config is the model's own
# --------------------------------------------------------------------------------------------------
def peaked_qwen3(tokenizer, prompt: str) -> tuple[torch.nn.Module, int]:
    """A tiny Qwen3 whose logits are scaled x1000 (sampling is greedy in effect) and the id it emits first."""
    model = build_tiny_qwen3(tokenizer, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(1000.0)
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        logits = model(input_ids=ids).logits[0, -1]
        logits[tokenizer.eos_token_id] = -float("inf")
    return model, int(logits.argmax())


def test_generation_stops_at_every_eos_and_the_saved_generation_config_is_unchanged(tmp_path, tokenizer):
    dataset = prompts(text="Same prompt:")  # 16 copies of one prompt
    model, first = peaked_qwen3(tokenizer, "Same prompt:")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]  # like Qwen3's two EOS ids
    original = model.generation_config.to_dict()
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=vowel_fraction,
        args=config(tmp_path, stop_token="eos"),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert trainer.stop_token_ids == [tokenizer.eos_token_id, first]
    batch = trainer.rollouts.sample(trainer.rollouts.collate([trainer.train_dataset[i] for i in (0, 1)]))
    # The model's second EOS comes first: every completion is that one token and ends there.
    assert batch.completion_ids[:, 0].tolist() == [first] * 8
    assert batch.lengths.tolist() == [1] * 8 and not batch.is_truncated.any()
    assert model.generation_config.to_dict() == original
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [tokenizer.eos_token_id, first]
    assert (
        GenerationConfig.from_dict(saved).to_diff_dict()
        == GenerationConfig.from_dict(original).to_diff_dict()
    )


def test_a_rollout_leaves_every_submodule_of_the_policy_in_the_mode_it_found_it(tmp_path, tokenizer):
    # Before: the rollout ended with policy.train(was_training), which puts every submodule in the top module's
    # mode, so a policy holding both (a from_pretrained base in eval mode, peft adapters in train mode) came
    # out of a rollout, e.g. an evaluation's between two steps, in another state than it went in.
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=config(tmp_path),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    policy.train()
    policy.model.layers[0].eval()
    modes = {name: module.training for name, module in policy.named_modules()}
    seen = []
    policy.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    trainer.rollouts.sample(trainer.rollouts.collate([trainer.train_dataset[i] for i in (0, 1)]))
    assert seen and not any(seen)  # sampled in eval mode
    assert {name: module.training for name, module in policy.named_modules()} == modes


def test_stop_token_none_never_stops_even_at_the_models_eos(tmp_path, tokenizer):
    dataset = prompts(text="Same prompt:")
    model, first = peaked_qwen3(tokenizer, "Same prompt:")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=vowel_fraction,
        args=config(tmp_path, stop_token=None),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    batch = trainer.rollouts.sample(trainer.rollouts.collate([trainer.train_dataset[i] for i in (0, 1)]))
    assert batch.completion_ids[:, 0].tolist() == [first] * 8
    assert batch.lengths.tolist() == [8] * 8 and batch.is_truncated.all()
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, first]


def test_checkpoint_sampling_filters_do_not_leak_into_rollouts(tmp_path, tokenizer):
    # Qwen2.5 ships repetition_penalty=1.05, Qwen3 top_k=20: generate() would apply them to every field the
    # rollout config leaves unset, and the rollout's logprobs would no longer be softmax(logits / T).
    model = build_tiny_qwen3(tokenizer, seed=0)
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.min_p = 0.2
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=vowel_fraction,
        args=config(tmp_path, num_ppo_epochs=1, num_mini_batches=1),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    assert trainer.train_step(0)["policy/approx_kl"] < 1e-6


# --------------------------------------------------------------------------------------------------
# Over-long prompts
# --------------------------------------------------------------------------------------------------
def mixed_lengths(n_long: int, n: int = 16) -> Dataset:
    rows = [
        [{"role": "user", "content": f"Q{i}: " + ("long " * 20 if i < n_long else "short")}] for i in range(n)
    ]
    return Dataset.from_dict({"prompt": rows, "answer": [str(i) for i in range(n)]})


def test_overlong_prompts_are_filtered_with_a_warning_by_default(tmp_path, tokenizer):
    # Short chat prompts are 42 tokens with the template, long ones 123.
    with pytest.warns(UserWarning) as record:
        trainer = SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=vowel_fraction,
            args=config(tmp_path, max_prompt_length=64),
            train_dataset=mixed_lengths(3),
            eval_dataset=mixed_lengths(2, n=4),
            processing_class=tokenizer,
        )
    messages = [str(w.message) for w in record if "max_prompt_length" in str(w.message)]
    assert len(messages) == 2
    assert "3 of 16 prompts in `train_dataset`" in messages[0] and "the longest has 123" in messages[0]
    assert "2 of 4 prompts in `eval_dataset`" in messages[1]
    assert len(trainer.train_dataset) == 13 and len(trainer.eval_dataset) == 2
    assert sorted(trainer.train_dataset["answer"], key=int) == [str(i) for i in range(3, 16)]
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 29
    assert trainer.train_dataset_len == 13


def test_overlong_prompts_truncate_or_error_when_asked(tmp_path, tokenizer):
    dataset = mixed_lengths(3)
    with pytest.warns(UserWarning, match="3 of 16 prompts .* truncating them to 64 tokens"):
        trainer = SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=vowel_fraction,
            args=config(tmp_path, max_prompt_length=64, overlong_prompts="truncate"),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    full = tokenizer.apply_chat_template(dataset[0]["prompt"], add_generation_prompt=True, tokenize=True)
    full = full["input_ids"] if hasattr(full, "keys") else full
    # the template's opening "<|im_start|>user\n" (6 tokens) stays, then the last 58 tokens
    assert len(trainer.train_dataset) == 16
    assert trainer.train_dataset[0]["input_ids"] == list(full)[:6] + list(full)[-58:]
    with pytest.raises(ValueError, match=r"3 of 16 prompts .* longest has 123.*overlong_prompts='filter'"):
        SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=vowel_fraction,
            args=config(tmp_path, max_prompt_length=64, overlong_prompts="error"),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    with pytest.raises(
        ValueError, match=r"every prompt in `train_dataset` is longer than max_prompt_length=8"
    ):
        SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=vowel_fraction,
            args=config(tmp_path, max_prompt_length=8),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match=r"SAEPPOConfig.overlong_prompts: 'drop' is unknown"):
        config(tmp_path, overlong_prompts="drop")


# --------------------------------------------------------------------------------------------------
# YAML recipes
# --------------------------------------------------------------------------------------------------
def test_recipe_yaml_syntax_error_names_the_file_and_line(capsys, tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nlearning_rate: [1e-6\nmax_steps: 3\n")
    code, _, err = run_cli(capsys, "train", str(recipe))
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err and len(lines) <= 2
    assert lines[0].startswith(f"trl-sae train: error: recipe {recipe}: invalid YAML at line 3")


@pytest.mark.parametrize("where", ["recipe", "command line"])
def test_a_wrongly_typed_value_is_one_line_not_the_usage(capsys, tmp_path, where):
    if where == "recipe":
        recipe = tmp_path / "typo.yaml"
        recipe.write_text("learning_rate: abc\nuse_cpu: true\n")
        argv, expected = [str(recipe)], f"recipe {recipe}: learning_rate: invalid float value: 'abc'"
    else:
        argv, expected = [RECIPE, "--learning_rate", "abc"], "--learning_rate: invalid float value: 'abc'"
    code, out, err = run_cli(capsys, "train", *argv)
    lines = err.strip().splitlines()
    assert code == 1 and "usage:" not in err + out and len(lines) == 2
    assert lines[0] == f"trl-sae train: error: {expected}" and lines[1].startswith("hint:")


# --------------------------------------------------------------------------------------------------
# Model arguments that are neither a folder nor reachable
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_missing_local_model_is_no_such_directory_at_once(tmp_path, tokenizer):
    for kwargs, shown in (
        (
            {"model": "./missing-model", "processing_class": tokenizer},
            "model: no such directory './missing-model'",
        ),
        ({"model": "~/missing/model"}, "model: no such directory '~/missing/model'"),
        (
            {
                "model": build_tiny_qwen3(tokenizer),
                "processing_class": tokenizer,
                "value_model": "a/b/critic",
            },
            "value_model: no such directory 'a/b/critic'",
        ),
    ):
        with pytest.raises(FileNotFoundError) as error:
            SAEPPOTrainer(
                reward_funcs=vowel_fraction, args=config(tmp_path), train_dataset=prompts(), **kwargs
            )
        # Our own message, raised before from_pretrained could start Hub retries.
        assert str(error.value).startswith(shown) and "\n" not in str(error.value)


def test_offline_hub_id_must_be_in_the_cache(tmp_path, tokenizer, offline):
    with pytest.raises(FileNotFoundError, match="'someone/not-cached' is not in the local cache"):
        SAEPPOTrainer(
            model="someone/not-cached",
            reward_funcs=vowel_fraction,
            args=config(tmp_path),
            train_dataset=prompts(),
            processing_class=tokenizer,
        )
    # A cached snapshot passes the check (and is loaded by from_pretrained from the cache).
    from trl_sae.hub import resolve_model_source

    cache = tmp_path / "hub-cache"
    snapshot = cache / "models--someone--cached" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--someone--cached" / "refs").mkdir()
    (cache / "models--someone--cached" / "refs" / "main").write_text("0123abc")
    assert resolve_model_source("someone/cached", init_kwargs={"cache_dir": str(cache)}) == "someone/cached"
    with pytest.raises(FileNotFoundError, match="not in the local cache"):
        resolve_model_source("someone/cached", init_kwargs={"cache_dir": str(cache), "revision": "v2"})


def test_recipe_with_an_uncached_hub_id_offline_is_one_line(capsys, offline):
    code, _, err = run_cli(
        capsys, "train", RECIPE, "--model_name_or_path", "someone/not-cached", "--use_cpu", "true"
    )
    first = err.strip().splitlines()[0]
    assert code == 1 and "Traceback" not in err
    assert first.startswith(
        "trl-sae train: error: model_name_or_path: no such directory 'someone/not-cached'"
    )
    assert "not in the local cache" in first


# --------------------------------------------------------------------------------------------------
# A model folder with nothing to load
# --------------------------------------------------------------------------------------------------
def test_an_empty_model_folder_says_what_it_should_hold(capsys, tmp_path, tokenizer):
    from trl_sae.hub import resolve_model_source

    folder = tmp_path / "model"
    folder.mkdir()
    code, _, err = run_cli(capsys, "segments", "--model", str(folder), "--text", "hi")
    # Before: "cannot load model ...: Couldn't instantiate the backend tokenizer from one of:" (cut off).
    assert code == 1 and err.splitlines()[0] == (
        f"trl-sae segments: error: --model: the folder {str(folder)!r} has no model or tokenizer files (it is "
        "empty); it should hold a model saved with save_pretrained or `hf download` (config.json, "
        "model.safetensors, tokenizer.json / tokenizer_config.json) or a LoRA adapter (adapter_config.json)."
    )
    (folder / "README.md").write_text("an interrupted download")
    with pytest.raises(FileNotFoundError, match=r"^model: the folder .* \(it holds only README\.md\)"):
        SAEPPOTrainer(
            model=str(folder), reward_funcs=vowel_fraction, args=config(tmp_path), train_dataset=prompts()
        )
    # Any model, tokenizer or adapter file makes it a folder to hand to from_pretrained.
    for name in ("config.json", "tokenizer_config.json", "adapter_config.json", "model.gguf"):
        other = tmp_path / name.replace(".", "-")
        other.mkdir()
        (other / name).write_text("{}")
        assert resolve_model_source(str(other)) == str(other)


# --------------------------------------------------------------------------------------------------
# A Hub id on a machine without network (and without HF_HUB_OFFLINE=1)
# --------------------------------------------------------------------------------------------------
class NoNetwork:
    """Stands in for huggingface_hub's HTTP session on a machine without network: every request fails
    as httpx does when DNS fails. Records the requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []

    def head(self, url, **kwargs):
        self.requests.append((url, kwargs))
        raise ConnectionError("[Errno -2] Name or service not known")


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    from trl_sae import hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # An empty cache, whatever this machine has downloaded.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    session = NoNetwork()
    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: session)
    _forget_hub_answer(hub)
    yield session
    _forget_hub_answer(hub)


def _forget_hub_answer(hub) -> None:
    """The Hub's reachability is asked once per process and kept: start (and leave) with no answer."""
    if hasattr(hub, "hub_unreachable"):
        hub.hub_unreachable.cache_clear()


def _cached_snapshot(cache: Path, repo: str) -> Path:
    """A Hub cache holding ``repo`` at ``main`` (huggingface_hub's layout)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abc")
    return snapshot


def test_a_hub_id_without_network_fails_at_once_after_one_request(no_network, monkeypatch):
    from trl_sae.hub import resolve_model_source

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.example.test")  # HF_ENDPOINT
    for what in ("model_name_or_path", "tokenizer_name_or_path"):
        with pytest.raises(FileNotFoundError) as error:
            resolve_model_source("someone/model", what)
        assert str(error.value) == (
            f"{what}: 'someone/model' is not a local folder nor in the local cache, and the Hub "
            "(https://hub.example.test) cannot be reached (ConnectionError: [Errno -2] Name or service not "
            "known); download it where there is network (`hf download someone/model --local-dir DIR`) and "
            "pass DIR."
        )
    # No retries (they took 27-50 s inside from_pretrained): one quick request to the configured endpoint,
    # for the whole process.
    assert [url for url, _ in no_network.requests] == ["https://hub.example.test"]
    assert 0 < no_network.requests[0][1]["timeout"] <= 5


def test_without_network_a_cached_hub_id_is_loaded_from_its_snapshot(no_network, tmp_path):
    from trl_sae.hub import resolve_model_source

    snapshot = _cached_snapshot(tmp_path / "cache", "someone/cached")
    resolved = resolve_model_source("someone/cached", init_kwargs={"cache_dir": str(tmp_path / "cache")})
    # The folder itself, so from_pretrained reads it without trying the Hub.
    assert Path(resolved).resolve() == snapshot.resolve()


def test_a_reachable_hub_leaves_the_hub_id_to_from_pretrained(monkeypatch):
    from trl_sae import hub

    class Answers:
        requests = 0

        def head(self, url, **kwargs):
            Answers.requests += 1
            return SimpleNamespace(status_code=200)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: Answers())
    _forget_hub_answer(hub)
    try:
        assert hub.resolve_model_source("someone/model") == "someone/model"
        assert Answers.requests == 1
    finally:
        _forget_hub_answer(hub)


def test_cli_hub_model_without_network_is_one_line_at_once(capsys, no_network, monkeypatch):
    def from_pretrained(*args, **kwargs):
        raise AssertionError("from_pretrained was reached: it would retry against the Hub")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", from_pretrained)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", from_pretrained)
    code, _, err = run_cli(capsys, "segments", "--model", "Qwen/Qwen3-0.6B", "--text", "hi")
    assert len(no_network.requests) == 1  # and from_pretrained, whose retries took 27-50 s, never ran
    assert code == 1 and err.splitlines()[0].startswith(
        "trl-sae segments: error: --model: 'Qwen/Qwen3-0.6B' is not a local folder nor in the local cache, "
        f"and the Hub ({huggingface_hub.constants.ENDPOINT}) cannot be reached"
    )


# --------------------------------------------------------------------------------------------------
# What the tokenizer and the datasets decide fails before any weight loads
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def no_template_dir(tmp_path, tokenizer):
    """A tiny model folder whose tokenizer has no chat template."""
    import copy

    path = tmp_path / "no-template"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    plain.save_pretrained(path)
    return path


@pytest.fixture
def policy_loads(monkeypatch):
    """Every call of the trainer's policy loader (the call still loads)."""
    from trl_sae.trainer import sae_ppo_trainer

    calls: list[str] = []
    load = sae_ppo_trainer.load_policy

    def counting(model, args):
        calls.append(str(model))
        return load(model, args)

    monkeypatch.setattr(sae_ppo_trainer, "load_policy", counting)
    return calls


def test_dataset_and_tokenizer_mistakes_fail_before_the_model_loads(tmp_path, no_template_dir, policy_loads):
    for dataset, message in (
        (prompts(chat=True), "`train_dataset` holds chat messages but the tokenizer has no chat template"),
        (prompts(n=1), "`train_dataset` has 1 prompts but one step needs 2"),  # 8 rows / 4 generations
    ):
        with pytest.raises(ValueError, match=message):
            SAEPPOTrainer(
                model=str(no_template_dir),
                reward_funcs=vowel_fraction,
                args=config(tmp_path),
                train_dataset=dataset,
            )
    assert policy_loads == []
    SAEPPOTrainer(
        model=str(no_template_dir),
        reward_funcs=vowel_fraction,
        args=config(tmp_path),
        train_dataset=prompts(),
    )
    assert policy_loads == [str(no_template_dir)]  # the counter sees a load


def test_recipe_chat_prompts_without_a_template_fail_before_the_model_loads(
    capsys, tmp_path, no_template_dir, policy_loads
):
    problems = tmp_path / "math.jsonl"
    problems.write_text(
        "".join(json.dumps({"problem": f"{i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    code, _, err = run_cli(
        capsys, "train", RECIPE, "--model_name_or_path", str(no_template_dir),
        "--dataset_name", str(problems), "--eval_dataset_name", str(problems),
        "--use_cpu", "true", "--bf16", "false", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 1 and "Traceback" not in err
    assert (
        "trl-sae train: error: `train_dataset` holds chat messages but the tokenizer has no chat template"
        in err
    )
    assert policy_loads == []
