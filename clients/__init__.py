"""Client side of tokenwire: the ZeroMQ client library, the jobs client, the
command line, and the in-process LLM API."""
