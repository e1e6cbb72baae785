"""What the two registries (advantage estimators, segmenters) share: reading the inputs a registered
function declares from its signature."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

__all__ = ["declared_inputs"]


def declared_inputs(kind: str, name: str, fn: Callable[..., object], inputs: Iterable[str]) -> frozenset[str]:
    """The documented ``inputs`` that ``fn`` names as keyword parameters (the ones it reads).

    ``fn`` is always called with every documented input as a keyword argument, so it must take ``**kwargs``
    for those it ignores, and every parameter it names without a default must be one of ``inputs``; both are
    checked here, at registration, instead of failing at the first training step.
    """
    if not callable(fn):
        raise TypeError(f"The {kind} {name!r} must be callable, got {type(fn).__name__}.")
    parameters = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise TypeError(
            f"The {kind} {name!r} must accept **kwargs: it is called with every input ({', '.join(inputs)}) "
            "as a keyword argument and ignores those it does not use."
        )
    known = set(inputs)
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    never_given = sorted(
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and (p.kind is inspect.Parameter.POSITIONAL_ONLY or (p.kind in keyword and p.name not in known))
    )
    if never_given:
        raise TypeError(
            f"The {kind} {name!r} requires {never_given}, which it is never given: it is called with the "
            f"keyword arguments {sorted(known)} only (bind other settings with functools.partial or a closure)."
        )
    return frozenset(p.name for p in parameters if p.kind in keyword and p.name in known)
