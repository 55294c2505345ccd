"""specgate.proto and the Python code generated from it (regenerate: `python -m gateway.grpc_api.proto.generate`)."""
