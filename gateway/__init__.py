"""specgate's front: CLI now; HTTP/gRPC, tenants and quotas later (see DESIGN.md)."""
