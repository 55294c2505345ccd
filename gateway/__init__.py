"""specgate's serving front: HTTP (`http/`), gRPC (`grpc_api/`), tenants and limits (`tenancy/`), the
generation service (`service/`), the Ray Serve deployments (`ray_serve/`), the parts an app is
assembled from (`assembly/`), the builders that assemble one (`builders/`) and the `serve`
commands (`cli/`); metrics, settings and text handling they share sit here.
docs/ARCHITECTURE.md has the layers and the import rules."""
