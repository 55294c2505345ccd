"""The two places that assemble an app: `embedded.py` (one process) and `ray_app.py` (Ray Serve)."""
