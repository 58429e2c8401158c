"""Taking requests in: the requests-topic consumer (its offsets, backpressure, the records it gives up on),
the pure classification of a record (commands), applying them to Redis and Kafka, the answers to rejected
requests, cancels, retries of failing records, and the reconcile pass.
"""
