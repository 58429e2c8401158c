"""ray_job."""
