"""Device-side work: model loading, token trees, the verifier, drafters, acceptance rules."""
