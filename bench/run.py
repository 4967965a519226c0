"""`make bench`: run every registered section and print one table each.

A section is a module with `TITLE: str` and `table() -> (header, rows)`. To add
one, write bench/<name>_bench.py and add a line to SECTIONS. A section that
cannot run here (a missing package, or `SkipSection`) prints a skip line.

    python -m bench.run            # all sections
    python -m bench.run protocol   # only these
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Sequence

from bench import SkipSection

SECTIONS: dict[str, str] = {
    "protocol": "bench.protocol_bench",
    "cpu": "bench.cpu_bench",
    "decoding": "bench.decoding_bench",
    "spec": "bench.spec_bench",
    "jobs": "bench.jobs_bench",
    "host": "bench.host_bench",
    "service": "bench.service_bench",
    "gpu": "bench.gpu_bench",
    "attention": "bench.attention_bench",
    "serving": "bench.serving_bench",
    "lora": "bench.lora_bench",
    "moe_kernel": "bench.moe_kernel_bench",
    "fleet": "bench.fleet_bench",
    "migration": "bench.migration_bench",
    "openai": "bench.openai_bench",
    "kv_transfer": "bench.kv_transfer_bench",
}


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def run_section(name: str, module_name: str) -> bool:
    """Print one section; False if it failed (a skip is not a failure)."""
    start = time.perf_counter()
    try:
        module = importlib.import_module(module_name)
        header, rows = module.table()
    except SkipSection as e:
        print(f"== {name}: skipped: {e}\n")
        return True
    except ModuleNotFoundError as e:
        print(f"== {name}: skipped: needs {e.name}\n")
        return True
    except Exception as e:
        print(f"== {name}: FAILED: {type(e).__name__}: {e}\n")
        return False
    title = getattr(module, "TITLE", name)
    print(f"== {title}  ({time.perf_counter() - start:.1f} s)")
    print(format_table(header, rows))
    print()
    return True


def main(argv: Sequence[str]) -> int:
    unknown = [n for n in argv if n not in SECTIONS]
    if unknown:
        print(f"unknown section(s): {', '.join(unknown)}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    ok = [run_section(name, SECTIONS[name]) for name in (argv or SECTIONS)]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
