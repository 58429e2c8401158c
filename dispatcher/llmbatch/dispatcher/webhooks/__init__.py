"""Signed webhooks of batch events: the endpoints' registry, the durable delivery queue in Redis, the
feed from the results topic and the deliverer (see :mod:`llmbatch.schemas.webhooks` for the format)."""
