"""Rollouts sampled by vLLM: TRL's ``VLLMGeneration`` adapted to PPO's needs.

What is reused from TRL 1.12 (``trl.generation.vllm_generation.VLLMGeneration``): the server client
(``VLLMClient``: generation over HTTP, weight streaming over NCCL), the server-mode ``generate`` (prompts
gathered on the main process, completions broadcast back), the tensor-parallel colocate ``generate``,
parameter gathering for full fine-tuning under FSDP and DeepSpeed ZeRO-3, and the sleep-mode bookkeeping.

What is different, and why (see docs/design.md, "vLLM rollouts"):

- The colocated engine starts from the policy's *config* with ``load_format="dummy"`` and receives its
  weights from the trainer before the first rollout. TRL loads ``model.name_or_path`` from disk, which fails
  for a model built in memory and, for a 4-bit QLoRA base, would load the stale quantized checkpoint.
- Colocated weights are pushed with vLLM's ``reload_weights`` (``collective_rpc``), not by calling the model's
  ``load_weights`` directly as TRL does: ``reload_weights`` wraps ``load_weights`` in vLLM's layer-wise
  reload, which re-runs each layer's post-load processing (weight repacking on the CPU backend, kernel
  layouts of quantized layers). ``load_weights`` alone fails on the CPU backend once it has repacked its
  linear weights. It is the same worker method on GPU and CPU (the CPU model runner subclasses the GPU one).
- On the CPU backend, the output head is re-packed after every push (``_repack_cpu_output_heads``): vLLM
  multiplies by a packed copy of each weight, and a head tied to the embeddings gets no weight of its own in
  the reload, so it would keep computing logits from the dummy start-up weights.
- A LoRA policy is merged *functionally*: ``named_weights`` yields the dequantized base weight plus the
  adapter's delta for each layer, cast to the engine's dtype, instead of PEFT's in-place
  ``merge_adapter``/``unmerge_adapter``. Merging into a 4-bit base in place re-quantizes the weights on
  every sync (the update is rounded away and the base drifts), and a shared-base critic's adapter must never
  be merged: only the policy adapter's delta is added, and the value head lives outside the PEFT model.
- Every row samples with its own seed: prompt ``p`` of a call is one request with ``n = num_generations`` and
  seed ``base + p * num_generations`` (vLLM seeds its copy ``k`` with ``seed + k``), ``base`` coming from the
  trainer's seed, step, process and stream. One ``SamplingParams(n, seed)`` for all prompts, as TRL sends,
  would give the ``k``-th completion of every prompt (in server mode: of the whole global batch) the same
  noise. Rollouts stay reproducible: a resumed run samples what the uninterrupted one did. Server mode sends
  one request per prompt for the same reason (the OpenAI endpoint takes one seed per request).
- Server mode opens the NCCL weight channel on the first sync rather than at start-up, so a server can be
  used for generation alone (``benchmarks/bench_rollout.py``, the CPU tests); the trainer refuses server
  mode on a machine without CUDA, where that channel cannot exist.
- A colocated call whose longest prompt plus ``max_completion_length`` exceeds the engine's context is refused:
  vLLM would silently stop those rows early, and PPO would train on the cut completions.

Completions stop on exactly the trainer's stop ids (``ignore_eos`` plus ``stop_token_ids``), the stop token
is kept and masked in, and sampling is pure (``top_k=0``, ``top_p=1``, ``min_p=0``, the config's
temperature) so vLLM's ``processed_logprobs`` are log-probabilities of ``softmax(logits / T)``, the
distribution the trainer's own forward evaluates.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from trl.import_utils import is_vllm_available  # TRL's check, re-exported for callers and tests

from trl_sae.generation.inputs import peft_base_model

__all__ = ["VLLMRollout", "VLLMRolloutOutput", "is_vllm_available", "rollout_tensors"]

NamedWeights = Callable[[], Iterator[tuple[str, torch.Tensor]]]

_INSTALL_HINT = 'pip install "trl-sae[vllm]" (on a CPU-only machine: see docs/guides/vllm.md)'


@dataclass
class VLLMRolloutOutput:
    """One batched vLLM rollout, aligned with the trainer's rows.

    Attributes:
        completion_ids: ``(B, T)`` long, right-padded with the pad id after the first stop token.
        completion_mask: ``(B, T)`` long, 1 up to and including the first stop token.
        logprobs: ``(B, T)`` float32, vLLM's log-probability of each sampled token under the distribution it
            sampled from (``processed_logprobs``: after temperature); 0 where the mask is 0 or vLLM gave none.
        is_truncated: ``(B,)`` bool, True where no stop token came within the budget.
        logprob_missing: ``(B, T)`` bool, True on valid tokens vLLM returned no (or a NaN) log-prob for; the
            trainer fills those with its own, so their importance ratio is 1. None: none missing.

    vLLM returns no entropies; the trainer takes them from its own forward pass.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    is_truncated: torch.Tensor
    logprob_missing: torch.Tensor | None = None


def rollout_tensors(
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float | None]],
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    device: torch.device | str | None = None,
) -> VLLMRolloutOutput:
    """Pad token-id and log-prob lists into the trainer's ``(B, T)`` tensors.

    The mask ends at the first stop id (kept); tokens after it, if an engine returned any, are padding. A
    log-prob vLLM could not give (``None``, NaN, or a row shorter than its tokens) is 0 in ``logprobs`` and
    flagged in ``logprob_missing``: 0 is no neutral value (its importance ratio would be ``p_trainer``), so the
    caller replaces it with the trainer's own log-prob.
    """
    width = max((len(ids) for ids in completions), default=0) or 1
    rows = len(completions)
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    values = torch.zeros((rows, width), dtype=torch.float32)
    missing = torch.zeros((rows, width), dtype=torch.bool)
    truncated = torch.ones(rows, dtype=torch.bool)
    stops = set(int(s) for s in stop_token_ids)
    for row, (tokens, row_logprobs) in enumerate(zip(completions, logprobs, strict=True)):
        tokens = list(tokens)
        end = len(tokens)
        for position, token in enumerate(tokens):
            if token in stops:
                end, truncated[row] = position + 1, False
                break
        ids[row, :end] = torch.tensor(tokens[:end], dtype=torch.long)
        mask[row, :end] = 1
        row_values = list(row_logprobs or [])[:end]
        row_values += [None] * (end - len(row_values))
        for position, value in enumerate(row_values):
            if value is None or value != value:
                missing[row, position] = True
            else:
                values[row, position] = float(value)
    return VLLMRolloutOutput(
        ids.to(device), mask.to(device), values.to(device), truncated.to(device), missing.to(device)
    )


def _engine_model_dir(model: Any, tokenizer: Any) -> str:
    """A temporary folder with what vLLM needs to build ``model`` (a ``PreTrainedModel``): its config (no
    quantization: the engine gets full-precision merged weights) and the tokenizer. Weights come later,
    from the trainer."""
    directory = tempfile.mkdtemp(prefix="trl-sae-vllm-")
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    # save_pretrained fills this in; a model built in memory has none, and vLLM picks its class from it.
    config_dict["architectures"] = config_dict.get("architectures") or [type(model).__name__]
    generation_config = getattr(model, "generation_config", None)
    (Path(directory) / "config.json").write_text(json.dumps(config_dict, indent=1, default=str))
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _load_vllm_generation() -> type:
    if not is_vllm_available():
        raise ImportError(f"use_vllm=True needs vLLM: {_INSTALL_HINT}.")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine runs in-process
    from trl.generation.vllm_generation import VLLMGeneration

    return VLLMGeneration


class VLLMRollout:
    """A vLLM engine (colocated) or server client that samples PPO rollouts and follows the policy's weights.

    Built by :class:`~trl_sae.SAEPPOTrainer` from its ``vllm_*`` settings; usable alone (the benchmark does).
    Its life: start (``__init__``), :meth:`sync_weights` after every optimizer step that changed the policy,
    :meth:`generate` per step, and sleep between rollouts when ``enable_sleep_mode`` is set.

    Args:
        model: the policy as the trainer holds it (a ``PreTrainedModel`` or ``PeftModel``).
        accelerator: the trainer's ``Accelerator``.
        tokenizer: the policy's tokenizer.
        mode: ``"colocate"`` (an engine in this process) or ``"server"`` (``trl vllm-serve``).
        temperature: sampling temperature.
        max_completion_length: generation budget (the trainer's ``response_length``).
        stop_token_ids: the ids that end a completion (empty: never stop early).
        named_weights: a function returning the ``(name, tensor)`` pairs to push, in Hugging Face checkpoint
            names; None pushes ``model.named_parameters()`` (gathered under FSDP / ZeRO-3 by TRL's code).
        dtype: the engine's dtype (a string vLLM accepts, e.g. ``"bfloat16"``).
        seed: the colocated engine's seed.
        enforce_eager: no CUDA graphs (always on CPU).
        server_base_url, server_host, server_port, server_timeout, group_port: server mode, as TRL's.
        tensor_parallel_size, gpu_memory_utilization, max_model_length, enable_sleep_mode, model_impl:
            colocate mode, as TRL's.
        kv_cache_memory_bytes: colocate mode: the KV cache's size (vLLM's ``kv_cache_memory_bytes``; None:
            vLLM's own sizing, on CPU ``VLLM_CPU_KVCACHE_SPACE``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        accelerator: Any,
        tokenizer: Any,
        *,
        mode: str = "colocate",
        temperature: float = 1.0,
        max_completion_length: int = 16,
        stop_token_ids: Sequence[int] = (),
        named_weights: NamedWeights | None = None,
        dtype: str = "auto",
        seed: int = 0,
        enforce_eager: bool | None = None,
        server_base_url: str | None = None,
        server_host: str = "127.0.0.1",
        server_port: int = 8000,
        server_timeout: float = 240.0,
        group_port: int = 51216,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.3,
        max_model_length: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool = False,
        model_impl: str = "vllm",
    ) -> None:
        base = _load_vllm_generation()
        # The engine reads these while it is being built, so they are set first.
        self.tokenizer = tokenizer
        self.stop_token_ids = [int(i) for i in stop_token_ids]
        self.named_weights = named_weights
        self.dtype = dtype
        self.seed = seed
        self.enforce_eager = enforce_eager
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        # A subclass made at run time: TRL's class can only be imported where vLLM is installed.
        self._engine = _engine_class(base)(
            self,
            model,
            accelerator,
            tokenizer,
            mode=mode,
            server_base_url=server_base_url,
            server_host=server_host,
            server_port=server_port,
            server_timeout=server_timeout,
            group_port=group_port,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_length=max_model_length,
            enable_sleep_mode=enable_sleep_mode,
            model_impl=model_impl,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            max_completion_length=max_completion_length,
            logprobs=0,
            generation_kwargs=None,
        )

    @property
    def mode(self) -> str:
        return self._engine.mode

    @property
    def llm(self) -> Any:
        """The colocated ``vllm.LLM`` (None in server mode)."""
        return getattr(self._engine, "llm", None)

    def sync_weights(self) -> None:
        """Push the policy's current weights into the engine (a collective: every process calls it)."""
        self._engine.sync_weights()

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int, seed: int
    ) -> VLLMRolloutOutput:
        """Sample ``num_generations`` completions for each prompt, row ``r`` with its own seed ``seed + r``.

        Args:
            prompt_ids: ``(B, P)`` left-padded; rows come in runs of ``num_generations`` copies of one prompt
                (as ``Rollouts.collate`` builds them).
            prompt_mask: ``(B, P)``, 0 on padding.
            num_generations: copies per prompt.
            seed: this call's base seed (the trainer's ``vllm_sampling_seed``: from its seed, step, process and
                stream). Prompt ``p`` samples with ``seed + p * num_generations``, which vLLM offsets by the copy.

        Returns:
            A :class:`VLLMRolloutOutput` whose rows align with ``prompt_ids``.
        """
        rows, width = prompt_ids.shape
        if rows % num_generations:
            raise ValueError(f"{rows} prompt rows are not runs of num_generations={num_generations}.")
        grouped = prompt_ids.view(-1, num_generations, width)
        if not bool((grouped == grouped[:, :1]).all()):
            raise ValueError("Prompt rows must come in runs of num_generations identical prompts.")
        unique = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(prompt_ids[::num_generations], prompt_mask[::num_generations])
        ]
        self._check_context(max(len(ids) for ids in unique))
        seeds = [seed + index * num_generations for index in range(len(unique))]
        completions, logprobs = self._engine.sample(unique, num_generations, seeds)
        return rollout_tensors(
            completions, logprobs, self.stop_token_ids, self.tokenizer.pad_token_id, prompt_ids.device
        )

    @property
    def max_model_length(self) -> int | None:
        """The colocated engine's context length in tokens (None in server mode: the server's own)."""
        llm = self.llm
        return None if llm is None else int(llm.llm_engine.model_config.max_model_len)

    def _check_context(self, longest_prompt: int) -> None:
        context = self.max_model_length
        budget = self._engine.max_completion_length
        if context is not None and longest_prompt + budget > context:
            raise ValueError(
                f"A prompt of {longest_prompt} tokens + max_completion_length={budget} (the trainer's "
                f"response_length) exceeds the vLLM engine's context of {context} tokens, and vLLM would cut its "
                "completions short; raise vllm_max_model_length or shorten the prompts (max_prompt_length)."
            )

    @contextmanager
    def sampling_temperature(self, temperature: float) -> Iterator[None]:
        """Sample at ``temperature`` (0: greedy, vLLM's argmax) inside the block, e.g. for an evaluation."""
        saved = self._engine.temperature
        self._engine.temperature = temperature
        try:
            yield
        finally:
            self._engine.temperature = saved

    def close(self) -> None:
        """Free the colocated engine's memory (the object is unusable afterwards)."""
        engine = getattr(self, "_engine", None)  # absent when __init__ failed before building it
        if engine is not None:
            engine.close()


def _engine_class(base: type) -> type:
    """TRL's ``VLLMGeneration`` with the PPO-specific start-up, weight push and sampling described above."""

    class _Engine(base):
        def __init__(self, owner: VLLMRollout, model: Any, accelerator: Any, tokenizer: Any, **kwargs: Any):
            self.owner = owner
            self._model_dir: str | None = None
            super().__init__(model, accelerator, tokenizer, **kwargs)

        # -- start ----------------------------------------------------------------------------------
        def _init_vllm(self) -> None:
            if self.mode == "server":
                from trl.generation.vllm_client import VLLMClient

                if self.accelerator.is_main_process:
                    base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                    self.vllm_client = VLLMClient(
                        base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
                    )
                self._communicator_ready = False
                self._llm_weights_sleeping = False
                self.accelerator.wait_for_everyone()
                return
            if self.mode != "colocate":
                raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.mode!r}.")
            self._start_colocated_engine()

        def _start_colocated_engine(self) -> None:
            from trl.trainer.utils import ensure_master_addr_port
            from vllm import LLM

            accelerator, owner = self.accelerator, self.owner
            if accelerator.num_processes % self.tensor_parallel_size:
                raise ValueError(
                    f"vllm_tensor_parallel_size={self.tensor_parallel_size} must divide the number of "
                    f"processes ({accelerator.num_processes})."
                )
            if self.tensor_parallel_size > 1:
                self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                    [
                        list(range(i * self.tensor_parallel_size, (i + 1) * self.tensor_parallel_size))
                        for i in range(accelerator.num_processes // self.tensor_parallel_size)
                    ]
                )
            # vLLM's external launcher joins the processes accelerate started.
            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            base = peft_base_model(self.model)
            self._model_dir = _engine_model_dir(base, owner.tokenizer)
            weakref.finalize(self, shutil.rmtree, self._model_dir, True)
            on_cpu = accelerator.device.type == "cpu"
            self.llm = LLM(
                model=self._model_dir,
                load_format="dummy",  # weights are pushed by sync_weights before the first rollout
                dtype=owner.dtype,
                tensor_parallel_size=self.tensor_parallel_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_length,
                kv_cache_memory_bytes=owner.kv_cache_memory_bytes,
                enable_sleep_mode=self.enable_sleep_mode,
                model_impl=self.model_impl,
                distributed_executor_backend="external_launcher",
                # One seed per tensor-parallel group: its ranks must sample the same tokens.
                seed=owner.seed + accelerator.process_index // self.tensor_parallel_size,
                # vLLM's memory profiler is misled by its default (32k) budget, as TRL notes.
                max_num_batched_tokens=4096,
                logprobs_mode="processed_logprobs",
                enforce_eager=on_cpu if owner.enforce_eager is None else owner.enforce_eager,
            )
            # Random (dummy) weights until the first sync: generate() pushes them before sampling.
            self._llm_weights_sleeping = True
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
            accelerator.wait_for_everyone()

        # -- weights --------------------------------------------------------------------------------
        def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
            named_weights = self.owner.named_weights
            if named_weights is None:
                yield from super()._iter_named_params()
                return
            # ZeRO-3: every process gathers the full parameters before the merge (a no-op otherwise).
            with self._dist.gather_params(list(self.model.parameters())):
                for name, tensor in named_weights():
                    yield self._fix_param_name_to_vllm(name), tensor

        def sync_weights(self) -> None:
            if self.mode == "server":
                if self.accelerator.is_main_process and not self._communicator_ready:
                    self.vllm_client.init_communicator(device=self.accelerator.device)
                self._communicator_ready = True
                super().sync_weights()
                return
            if self.enable_sleep_mode:
                from trl.generation.vllm_generation import empty_cache

                empty_cache()
                self.llm.wake_up(tags=["weights"])
            dtype = _torch_dtype(self.llm)
            weights = ((name, tensor.to(dtype)) for name, tensor in self._iter_named_params())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self.accelerator.device.type == "cpu":
                self.llm.collective_rpc(_repack_cpu_output_heads)
            self.llm.reset_prefix_cache()
            self._llm_weights_sleeping = False

        # -- sampling -------------------------------------------------------------------------------
        def sample(
            self, prompts: list[list[int]], num_generations: int, seeds: list[int]
        ) -> tuple[list[list[int]], list[list[float | None]]]:
            """Completions and their sampled tokens' log-probs, ``num_generations`` per prompt, prompt-major;
            prompt ``i`` samples with ``seeds[i]`` (vLLM adds the copy's index)."""
            stops = self.owner.stop_token_ids
            if self.mode == "server":
                return self._sample_server(prompts, num_generations, seeds, stops)
            if self.tensor_parallel_size == 1:
                return self._sample_colocated(prompts, num_generations, seeds, stops)
            # TRL's tensor-parallel colocate path: one unseeded request per copy (independent draws from the
            # engine's generator, not reproducible).
            self.generation_kwargs = {"stop_token_ids": stops, "ignore_eos": True}
            repeated = [ids for ids in prompts for _ in range(num_generations)]
            _, completions, logprobs, _ = super().generate(repeated, None, num_generations)
            return [list(c) for c in completions], [[lp[0] for lp in row] for row in logprobs]

        def _sample_server(
            self, prompts: list[list[int]], num_generations: int, seeds: list[int], stops: list[int]
        ) -> tuple[list[list[int]], list[list[float | None]]]:
            """All processes' prompts, one request each with its own seed, sent by the main process."""
            from concurrent.futures import ThreadPoolExecutor

            from accelerate.utils import broadcast_object_list, gather_object

            counts = gather_object([len(prompts)])
            all_prompts, all_seeds = gather_object(prompts), gather_object(seeds)
            results = None
            if self.accelerator.is_main_process:

                def send(index: int) -> tuple[list[list[int]], list[list[float | None]]]:
                    out = self.vllm_client.generate(
                        prompts=[all_prompts[index]],
                        n=num_generations,
                        temperature=self.temperature,
                        top_p=1.0,
                        top_k=0,
                        min_p=0.0,
                        max_tokens=self.max_completion_length,
                        logprobs=0,
                        generation_kwargs={
                            "seed": all_seeds[index],
                            "stop_token_ids": stops,
                            "ignore_eos": True,
                        },
                    )
                    rows = out["logprobs"] or [[] for _ in out["completion_ids"]]
                    return out["completion_ids"], [[lp[0] if lp else None for lp in row] for row in rows]

                with ThreadPoolExecutor(max_workers=min(64, max(1, len(all_prompts)))) as pool:
                    results = list(pool.map(send, range(len(all_prompts))))
            payload = [results]
            broadcast_object_list(payload, from_process=0)
            start = sum(counts[: self.accelerator.process_index])
            mine = payload[0][start : start + len(prompts)]
            completions = [list(ids) for ids_per_prompt, _ in mine for ids in ids_per_prompt]
            logprobs = [row for _, rows in mine for row in rows]
            return completions, logprobs

        def _sample_colocated(
            self, prompts: list[list[int]], num_generations: int, seeds: list[int], stops: list[int]
        ) -> tuple[list[list[int]], list[list[float | None]]]:
            from vllm import SamplingParams

            if self._llm_weights_sleeping:  # never synced yet, or sleep level 2 dropped the weights
                self.sync_weights()
            if self.enable_sleep_mode:
                self.llm.wake_up(tags=["kv_cache"])
            params = [
                SamplingParams(
                    n=num_generations,
                    temperature=self.temperature,
                    top_p=1.0,
                    top_k=0,
                    min_p=0.0,
                    max_tokens=self.max_completion_length,
                    logprobs=0,
                    stop_token_ids=stops,
                    ignore_eos=True,  # stop on exactly the trainer's ids, as the Transformers path does
                    seed=seed,  # one per prompt: a shared seed repeats the noise of copy k across prompts
                    detokenize=False,
                )
                for seed in seeds
            ]
            outputs = self.llm.generate(
                [{"prompt_token_ids": ids} for ids in prompts], sampling_params=params, use_tqdm=False
            )
            completions, logprobs = [], []
            for request in outputs:
                for sample in request.outputs:
                    tokens = list(sample.token_ids)
                    completions.append(tokens)
                    logprobs.append(
                        [
                            step[token].logprob if step and token in step else None
                            for step, token in zip(sample.logprobs or [], tokens)
                        ]
                    )
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
                self._llm_weights_sleeping = True
            return completions, logprobs

        def close(self) -> None:
            llm = getattr(self, "llm", None)
            if llm is not None:
                self.llm = None
                _release_in_process_engine(llm)
                del llm
                gc.collect()
            if self._model_dir is not None:
                shutil.rmtree(self._model_dir, ignore_errors=True)

    return _Engine


def _release_in_process_engine(llm: Any) -> None:
    """Free what a colocated (in-process) engine holds: weights, KV cache, forward context.

    Dropping the ``LLM`` is not enough: the engine core ``gc.freeze()``s what it built at start-up, so
    those objects are never collected, and each engine kept its KV cache (``VLLM_CPU_KVCACHE_SPACE``
    GiB on CPU) for the life of the process. This runs the worker and scheduler halves of vLLM's
    ``EngineCore.shutdown``; the rest of it tears down ``torch.distributed``, which the trainer's
    processes still use, so it is left out.
    """
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:  # a multiprocess client: the engine's own process frees its memory
        return
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()


def _repack_cpu_output_heads(worker: Any) -> int:
    """Rebuild the CPU GEMM kernels of every layer that computes logits from a weight it keeps (the output
    head, and the embedding it may be tied to) from that weight's current values; returns how many.

    Runs inside the engine's worker (``collective_rpc``) after ``reload_weights``. vLLM's CPU backend multiplies
    by a packed (oneDNN) copy of each weight, built by the layer's ``process_weights_after_loading``. A head tied
    to the input embeddings (SmolLM2, Qwen3-0.6B, ``tie_word_embeddings``) receives no weight of its own: the
    model's ``load_weights`` skips ``lm_head.*``, so the layer-wise reload only puts its tensor back and never
    re-packs it. The shared tensor holds the pushed values, but the logits kept coming from the packed copy of
    the start-up's dummy weights: SmolLM2's first rollout sampled random tokens, 15 nats off the trainer. Linear
    layers drop their weight once packed (``numel() == 0``) and were re-packed by the reload itself.
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    repacked = 0
    for module in worker.model_runner.model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        keeps_weight = weight is not None and weight.numel() > 0
        if hasattr(module, "cpu_linear") and keeps_weight and isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _torch_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine's model runs in (weights are cast to it before the push)."""
    return llm.llm_engine.model_config.dtype
