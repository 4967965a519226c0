"""`--quantization` and `--kv-cache-dtype` through the engine process to what the worker
tells gateways and its log: the engine's info and the Ready message name how the model is
quantized, and the info names the KV cache's type."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from protocol import codec
from protocol.control import Ready
from tests.checkpoints import make_checkpoint
from worker.service.__main__ import add_arguments
from worker.service.engine import EngineConfig, EngineFailed, EngineProcess


def test_engine_and_ready_name_the_quantization(tmp_path: Path) -> None:
    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--quantization", "int4"]).quantization == "int4"
    config = EngineConfig(str(ckpt), 8, 512, 1, 4096, (), "numpy", None, "WARNING", "text", quantization="int4")
    engine = EngineProcess(config)
    try:
        assert engine.info.quantization == "int4 (quantized on load, int4 RTN)"
    finally:
        engine.shutdown()
    float_engine = EngineProcess(dataclasses.replace(config, quantization=None))
    try:
        assert float_engine.info.quantization is None
    finally:
        float_engine.shutdown()
    ready = Ready(sender_id="w0", role="worker", heartbeat_interval_s=1.0, quantization=engine.info.quantization)
    decoded = codec.decode(codec.encode(ready))
    assert isinstance(decoded, Ready) and decoded.quantization == "int4 (quantized on load, int4 RTN)"


def test_an_fp8_kv_cache_from_the_flag_to_the_engine(tmp_path: Path) -> None:
    """`--kv-cache-dtype fp8` builds the torch backend's pool in e4m3 and says so; the numpy
    backend, which has no such cache, refuses it in one line."""
    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    config = EngineConfig(str(ckpt), 8, 512, 1, 4096, (), "torch", "cpu", "WARNING", "text", kv_cache_dtype="fp8")
    engine = EngineProcess(config)
    try:
        assert engine.info.kv_cache_dtype == "fp8"
    finally:
        engine.shutdown()
    with pytest.raises(EngineFailed, match="fp8 KV cache needs the torch backend"):
        EngineProcess(dataclasses.replace(config, backend="numpy"))
