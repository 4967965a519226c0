"""The worker: one executor per GPU (executor, models, backends: pure compute),
wrapped by the ZeroMQ + Redis service (service)."""
