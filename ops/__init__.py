"""Operations: what the service processes share to run under systemd —
sd_notify, configuration files, Prometheus metrics, structured logs. The unit
files and config examples live beside this package (ops/systemd, ops/*.toml).
Imports nothing of the worker's compute layers."""
