"""The HTTP front: the FastAPI app, its routers and dependencies, and the uvicorn server."""
