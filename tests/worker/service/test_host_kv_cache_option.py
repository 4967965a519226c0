"""`tokenwire worker --host-kv-cache-gb` reaches the block manager as host-tier
blocks; a negative size or one past the host's memory is refused in one line."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from worker.service.__main__ import add_arguments, main
from worker.service.engine import EngineConfig, build_core


def test_the_flag_sizes_the_host_tier(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).host_kv_cache_gb == 0.0
    assert parser.parse_args(["--host-kv-cache-gb", "0.5"]).host_kv_cache_gb == 0.5

    ckpt = make_checkpoint("llama_gqa", tmp_path / "llama")
    config = EngineConfig(str(ckpt), 8, 512, 1, 1024, (), "numpy", None, "WARNING", "text")
    core, _ = build_core(config)
    assert core.blocks.host is None
    # float32 K and V of 2 layers x 2 KV heads x 16 dims: 512 bytes a token, 16 KiB a 32-token block
    core, _ = build_core(dataclasses.replace(config, host_kv_cache_bytes=1 << 20))
    assert core.blocks.host is not None and core.blocks.host.num_blocks == (1 << 20) // (512 * 32)


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(SystemExit) as e:
        main(["--host-kv-cache-gb", "-1"])
    message = str(e.value)
    assert "--host-kv-cache-gb" in message and "greater than or equal to 0" in message
    assert "\n" not in message.strip()


def test_more_than_the_hosts_memory_is_refused() -> None:
    total_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / (1 << 30)
    with pytest.raises(SystemExit) as e:
        main(["--host-kv-cache-gb", str(2 * total_gib)])
    assert str(e.value) == (
        f"tokenwire worker: --host-kv-cache-gb {2 * total_gib:g} is more than this host's memory ({total_gib:.1f} GiB)"
    )
