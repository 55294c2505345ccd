"""specgate.proto and the Python code generated from it (regenerate: `python -m gateway.proto.generate`)."""
