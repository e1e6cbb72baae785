"""What the update optimises, as plain tensor functions: the PPO loss terms (:mod:`.losses`), reward shaping
and the high-entropy token mask (:mod:`.shaping`), and DAPO's dynamic sampling of prompt groups
(:mod:`.dynamic_sampling`)."""

# A namespace for its modules: import names from them (the modules above), so none is exported twice.
__all__: list[str] = []
