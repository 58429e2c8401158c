"""The engines: the backends (vLLM, the fake, plug-ins), the runner that shares one engine among
batches in fair order, the engines' process environment, and the warm engines shared on Ray Serve
(application, client, metrics, autoscaling)."""
