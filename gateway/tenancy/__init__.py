"""Tenants: records and key digests, the tenants file, the registry, rate limits and quotas."""
