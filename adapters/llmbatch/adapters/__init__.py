"""The adapters every llmbatch unit shares, above the contracts and settings: Kafka (publish, read
events, topics), S3 (uploads, results) and the errors they raise (each with ``retriable``).

Importing this package imports neither aiokafka nor minio; each module loads its client library."""
