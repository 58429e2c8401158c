"""Where batches run: the backend protocol, Ray Jobs (one job per batch), the batch runner on the shared
Serve engines, the Serve REST API and the engine registry's applications, S3 sessions handed to jobs.
"""
