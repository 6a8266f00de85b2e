"""The HTTP side of czyx: endpoints served by ``czyx serve`` (Starlette on uvicorn)."""
