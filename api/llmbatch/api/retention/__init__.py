"""Retention of the API's files and the batches' results: their expiry dates and the 404 past them
(:mod:`llmbatch.api.batches.expiry`), the collector that deletes what expired
(:mod:`~llmbatch.api.retention.collector`) and ``llmbatch retention`` (:mod:`~llmbatch.api.retention.cli`)."""
