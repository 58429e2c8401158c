"""The dispatcher's Kafka side beyond the consumer: publishing events and dead letters, reading single
records back (request bodies kept by coordinates), side consumers.
"""
