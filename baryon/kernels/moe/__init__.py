"""Mixture-of-experts kernels: routing (which experts each token goes to, with what weight) and
the expert computation (grouped GEMMs over the tokens each expert received)."""
