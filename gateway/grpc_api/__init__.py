"""The gRPC front: the servicer over the generation service, and the generated stubs."""
