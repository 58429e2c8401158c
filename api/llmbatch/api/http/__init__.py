"""The HTTP edge: the FastAPI application (:mod:`~llmbatch.api.http.app`) that wires the services from
their ports and serves OpenAI's Files and Batches routes over them, every error in OpenAI's shape."""
