"""An OpenAI-compatible HTTP gateway in front of Baton's gRPC ``baton.v1.Generation`` API.

``gateway.app.create_app(target)`` builds the ASGI app; ``baton gateway`` serves it with uvicorn.
Nothing is imported here, so that building the ``baton`` command line stays cheap.
"""
