"""The critics: the policy beside a separate critic model and the shared-base critic (a second adapter on
the policy's base) in :mod:`.policy_and_critic`, the head critic (a value head on the policy's own forward)
in :mod:`.head`, the decoder layers a shared-base critic computes once for every adapter in
:mod:`.shared_prefix`, and building each of them in :mod:`.build`."""

# A namespace for its modules: import names from them (the modules above), so none is exported twice.
__all__: list[str] = []
