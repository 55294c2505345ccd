"""The two places that assemble an app, from the parts in `gateway.assembly`: `embedded.py` (one
process) and `ray_app.py` (Ray Serve: the topology of its deployments)."""
