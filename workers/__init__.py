"""Device-side work: model loading, the lean forward and its kernels, token trees, the verifier,
drafters, acceptance rules, step-cost measurement; and `contract.py`, the plain data the scheduler
hands the workers and gets back."""
