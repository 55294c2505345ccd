"""specgate's serving front: HTTP (`http/`), gRPC (`grpc_api/`), tenants and limits (`tenancy/`), the
Ray Serve deployments (`ray_serve/`), the builders that assemble an app (`builders/`) and the
`serve` commands (`cli/`); the generation service, metrics and settings they share sit here.
docs/ARCHITECTURE.md has the layers and the import rules."""
