"""How a layer's weights are stored and multiplied: a `LinearMethod` per layer (dense by default)."""
