"""Checkpoints: the folders (manifests, verification, rotation, what a run may resume from:
:mod:`.folders`) and what a checkpoint holds and how it is saved and restored (:mod:`.state`)."""

# A namespace for its modules: import names from them (the modules above), so none is exported twice.
__all__: list[str] = []
