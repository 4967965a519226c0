"""The worker process: one executor behind a ZeroMQ ROUTER, with Redis for the
registry, cancel flags and stats. See `server.WorkerService`."""
