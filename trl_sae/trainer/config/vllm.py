"""vLLM rollouts (trl_sae/generation/vllm_backend.py); names and meanings as TRL 1.12's GRPOConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trl_sae.trainer.config.inherited import field_default

__all__ = ["IMPORTANCE_SAMPLING_MODES", "VLLM_MODES", "VLLMConfig"]

VLLM_MODES = ("colocate", "server")
# How vLLM's sampling ratio corrects the policy loss (trainer/objectives/losses.py: importance_sampling_weights).
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class VLLMConfig:
    """vLLM rollouts (trl_sae/generation/vllm_backend.py); names and meanings as TRL 1.12's GRPOConfig. Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    # vLLM rollouts (trl_sae/generation/vllm_backend.py); names and meanings as TRL 1.12's GRPOConfig.
    use_vllm: bool = field(
        default=False, metadata={"help": "Sample rollouts with vLLM (needs trl-sae[vllm])."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "colocate (an engine in each training process) or server (trl vllm-serve)."},
    )
    vllm_model_impl: str = field(
        default="vllm", metadata={"help": "Model implementation vLLM runs: vllm or transformers."}
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={"help": "Colocate: free the engine's weights and KV cache during the update (CUDA)."},
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Server URL; overrides vllm_server_host and vllm_server_port."}
    )
    vllm_server_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Server host (the server has no authentication: keep it on loopback)."},
    )
    vllm_server_port: int = field(default=8000, metadata={"help": "Server port."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the server before failing."}
    )
    vllm_group_port: int = field(
        default=51216, metadata={"help": "Port of the NCCL weight-update group with the server."}
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate: fraction of GPU memory for the engine."}
    )
    vllm_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "Colocate: the engine's KV cache in GiB (vLLM's kv_cache_memory_bytes); on CPU in place of "
            "VLLM_CPU_KVCACHE_SPACE (None: that variable, else vLLM's share of RAM; on GPU, "
            "vllm_gpu_memory_utilization)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Colocate: engine context length, >= max_prompt_length + response_length (default: that, "
            "within the model's max_position_embeddings)."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Colocate: tensor-parallel processes per engine."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "Weight the policy loss by the truncated ratio pi_trainer / pi_vllm."},
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": "token_truncate, token_mask, sequence_truncate or sequence_mask."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Importance ratio upper bound C_max (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Importance ratio lower bound C_min (None: none)."}
    )

    def _validate_vllm(self, fail: Any) -> None:
        vllm_fields = [f for f in dataclasses.fields(self) if f.name.startswith("vllm_")]
        if not self.use_vllm:
            changed = [f.name for f in vllm_fields if getattr(self, f.name) != field_default(f)]
            if changed:
                fail(
                    changed[0],
                    "is set but use_vllm=False, so it would do nothing; set use_vllm=True or drop it.",
                )
            return
        if self.vllm_mode not in VLLM_MODES:
            fail("vllm_mode", f"must be one of {list(VLLM_MODES)}, got {self.vllm_mode!r}.")
        if self.vllm_model_impl not in ("vllm", "transformers"):
            fail("vllm_model_impl", f"must be 'vllm' or 'transformers', got {self.vllm_model_impl!r}.")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            fail("vllm_gpu_memory_utilization", f"must be in (0, 1], got {self.vllm_gpu_memory_utilization}.")
        if self.vllm_tensor_parallel_size < 1:
            fail("vllm_tensor_parallel_size", f"must be >= 1, got {self.vllm_tensor_parallel_size}.")
        if self.vllm_kv_cache_gib is not None and not self.vllm_kv_cache_gib > 0:
            fail("vllm_kv_cache_gib", f"must be > 0 GiB or None, got {self.vllm_kv_cache_gib}.")
        # vLLM silently cuts a row whose prompt + max_tokens exceeds the context, so a context that cannot hold
        # the longest allowed prompt plus a full response would train on truncated completions.
        needed = (self.max_prompt_length or 1) + self.response_length
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < needed:
            held = (
                f"max_prompt_length={self.max_prompt_length} + response_length={self.response_length} = {needed}"
                if self.max_prompt_length is not None
                else f"a prompt and response_length={self.response_length} new tokens"
            )
            fail(
                "vllm_max_model_length",
                f"{self.vllm_max_model_length} cannot hold {held} tokens, so vLLM would cut completions short; "
                f"set vllm_max_model_length >= {needed}, lower max_prompt_length, or leave it None.",
            )
        if not self.vllm_server_timeout > 0:
            fail("vllm_server_timeout", f"must be > 0 seconds, got {self.vllm_server_timeout}.")
        for name in ("vllm_server_port", "vllm_group_port"):
            if not 0 < getattr(self, name) < 65536:
                fail(name, f"must be a TCP port (1-65535), got {getattr(self, name)}.")
        if self.vllm_mode == "colocate":
            server_only = (
                "vllm_server_base_url",
                "vllm_server_host",
                "vllm_server_port",
                "vllm_server_timeout",
            )
            for f in vllm_fields:
                if f.name in (*server_only, "vllm_group_port") and getattr(self, f.name) != field_default(f):
                    fail(f.name, "only applies to vllm_mode='server'; drop it or set vllm_mode='server'.")
        else:
            colocate_only = (
                "vllm_enable_sleep_mode",
                "vllm_gpu_memory_utilization",
                "vllm_max_model_length",
                "vllm_kv_cache_gib",
                "vllm_tensor_parallel_size",
                "vllm_model_impl",
            )
            for f in vllm_fields:
                if f.name in colocate_only and getattr(self, f.name) != field_default(f):
                    fail(
                        f.name,
                        "only applies to vllm_mode='colocate'; with a server, pass it to `trl vllm-serve` "
                        "instead (docs/guides/vllm.md).",
                    )
        if self.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
            fail(
                "vllm_importance_sampling_mode",
                f"must be one of {list(IMPORTANCE_SAMPLING_MODES)}, got {self.vllm_importance_sampling_mode!r}.",
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low < 0:
            fail("vllm_importance_sampling_clip_min", f"must be >= 0 or None, got {low}.")
        if high is not None and high <= 0:
            fail("vllm_importance_sampling_clip_max", f"must be > 0 or None, got {high}.")
        if low is not None and high is not None and low > high:
            fail(
                "vllm_importance_sampling_clip_min",
                f"{low} is above vllm_importance_sampling_clip_max={high}.",
            )
        if not self.vllm_importance_sampling_correction:
            is_fields = (
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max",
                "vllm_importance_sampling_clip_min",
            )
            for f in vllm_fields:
                if f.name in is_fields and getattr(self, f.name) != field_default(f):
                    fail(f.name, "is set but vllm_importance_sampling_correction=False; drop one of them.")
