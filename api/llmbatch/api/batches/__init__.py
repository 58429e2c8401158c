"""Batches through the API: creates and cancels as the producer's events
(:mod:`~llmbatch.api.batches.batches`), idempotent creates (:mod:`~llmbatch.api.batches.idempotency`), reads
of a batch's record with the dispatcher's state (:mod:`~llmbatch.api.batches.batch_reader`) mapped onto
OpenAI's Batch (:mod:`~llmbatch.api.batches.status`, pure), the listing order
(:mod:`~llmbatch.api.batches.listing`), its result shards as one file
(:mod:`~llmbatch.api.batches.results`), and when files and results expire
(:mod:`~llmbatch.api.batches.expiry`)."""
