"""Drafters: anything that proposes a token tree. Chosen by name from the registry."""
