"""`specgate serve` and `specgate serve --ray`: flags, then a builder, then listening."""
