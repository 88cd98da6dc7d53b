"""One file per model family: how its config.json reads and what its checkpoint names differently
(registry.FAMILIES lists them). The layer itself is shared (model/forward.py, model/weights.py),
switched by the ModelConfig fields a family sets."""
