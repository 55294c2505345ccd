"""Speculation: token trees, acceptance rules, the verifier and the batch worker."""
