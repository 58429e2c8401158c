"""Least privilege per component: the Kafka ACLs, Redis ACL users and MinIO policies each role needs, and
the commands that apply them.
"""
