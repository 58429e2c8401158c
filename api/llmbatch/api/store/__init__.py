"""Where the API keeps and reads what it knows: object storage (:mod:`~llmbatch.api.store.storage`, a port
and its MinIO implementation), the ids and records it keeps there (:mod:`~llmbatch.api.store.records`), and
the dispatcher's batch state in Redis (:mod:`~llmbatch.api.store.state`)."""
