"""A tenant's webhook endpoints through the API, ``/v1/webhook_endpoints``
(:mod:`~llmbatch.api.webhooks.webhooks`); the dispatcher delivers the events."""
