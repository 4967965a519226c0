"""The gateway process: clients in, workers out, text <-> tokens in between.
See `server.Gateway`."""
