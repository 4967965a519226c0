"""The software and device a GPU bench ran on, for its table's heading and its JSON."""

from __future__ import annotations

import datetime
import sys

import torch


def environment(device: torch.device) -> dict[str, str]:
    import transformers

    env = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "absent"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
    return env
