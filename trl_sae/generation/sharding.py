"""Passes over a sharded model (FSDP2, ZeRO-3): gathering what an FSDP2 root holds itself, and agreeing how
often every process calls a sharded output head.

A sharded module's forward is a collective: every process must call it, and as often as the others, or the
run hangs. :func:`fsdp2_root_unsharded` gathers the root's own parameters for calls that skip the root's
forward (``policy.generate``, the reference log-probs); :func:`agreed_head_calls` tells the chunked
log-prob pass (:func:`trl_sae.generation.capture.logprobs_from_hidden_states`) how many head calls every
process makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["agreed_head_calls", "fsdp2_root_unsharded", "has_fsdp2_modules", "head_is_sharded"]


def has_fsdp2_modules(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2, as accelerate applies it) sharded ``model`` or any module inside it.

    transformers' ``is_fsdp_managed_module`` sees FSDP1 wrappers and its own ``apply_fsdp2`` flag only; the
    policy handed to ``generate`` is a child of the sharded root whose decoder layers are ``FSDPModule``s.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


@contextmanager
def fsdp2_root_unsharded(root: torch.nn.Module) -> Iterator[None]:
    """Gather the parameters that an FSDP2 root module holds itself, for calls to its submodules.

    ``fully_shard`` unshards the root's own parameters (those outside the wrapped decoder layers: embeddings,
    final norm, output head, value head) in the root's forward pre-hook only. Calling a child directly
    (``policy.generate``, the reference log-probs) skips that hook and meets sharded ``DTensor`` weights. The
    wrapped layers inside keep their own hooks and gather layer by layer, so every rank must take part in
    every forward step (``synced_gpus``). A no-op for any module that is not an FSDP2 root.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    if not isinstance(root, FSDPModule):
        yield
        return
    # The first module to run forward becomes FSDP2's root (its lazy init); a child's forward before any root
    # forward would claim that role, so initialise from the real root first (what its forward would do).
    root._get_fsdp_state()._lazy_init()
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


def head_is_sharded(head: torch.nn.Module) -> bool:
    """Whether calling ``head`` is a collective: ZeRO-3 partitions its weight (DeepSpeed's ``ds_id``, unless it
    is persistent, i.e. kept whole on every rank) or FSDP wraps it as a unit of its own (each call gathers).
    A head inside a larger FSDP2 unit is gathered once by that unit and is not sharded while it runs."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    if isinstance(head, FSDPModule) or type(head).__name__ == "FullyShardedDataParallel":
        return True
    return any(hasattr(p, "ds_id") and not getattr(p, "ds_persist", False) for p in head.parameters())


def agreed_head_calls(head: torch.nn.Module, local_calls: int, device: torch.device) -> int:
    """The number of head calls every process makes: the most any process needs when the head is sharded
    (one all-reduce of one number), else ``local_calls``.

    An all-reduce rather than a count fixed by the shapes: the processes' batches have different numbers of
    rows (token-budget micro-batches) and completion widths, so only the valid-token count bounds the calls,
    and padding every process to a worst case (rows x response_length) would multiply the head's work. The
    processes reach this point equally often: a sharded model's every forward is collective already.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local_calls
    if torch.distributed.get_world_size() <= 1 or not head_is_sharded(head):
        return local_calls
    count = torch.tensor([local_calls], dtype=torch.long, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())
