"""Count the stops of wrapping a model (issue 55 item 5): the project's files that ``wrap_model`` passes through.

Every Python call made while ``lightning_fairscale.fsdp.engine.wrap_model`` shards a small model (``Net`` of the unit
tests: two blocks wrapped by ``auto_wrap_policy``, activation checkpointing, an Adam re-pointed; one gloo rank) is
traced with ``sys.setprofile``; the calls into the project's own files (``src/lightning_fairscale``), in order, with
consecutive calls in the same file counted once, are its *stops*. ``files`` is how many different files they are in,
``returns`` how many stops come back to a file left before (``stops - files``), and ``calls`` how many calls into the
project's functions were made in all. Calls into torch, FairScale or the standard library in between are not stops.

Run from the repository root (``PYTHONPATH`` chooses the source measured)::

    PYTHONPATH=$PWD/src .venv/bin/python tools/wrap_stops.py [--list]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def measure() -> tuple[list[str], int]:
    """The files of the stops of one ``wrap_model``, in order, and the number of calls into the project."""
    import lightning_fairscale
    from lightning_fairscale.fsdp import engine
    from lightning_fairscale.fsdp.config import FullyShardedConfig
    from lightning_fairscale.fsdp.patches import cpu_streams
    from unit.helpers import Block, Net

    root = str(Path(lightning_fairscale.__file__).resolve().parent) + "/"
    cpu_streams.install()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = FullyShardedConfig(auto_wrap_policy={Block}, activation_checkpointing=Block, bucket_cap_mb=1)
    groups = engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=timedelta(60))
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    stops: list[str] = []
    calls = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return
        calls += 1
        name = path[len(root) :]
        if not stops or stops[-1] != name:
            stops.append(name)

    sys.setprofile(profile)
    try:
        engine.wrap_model(config, model, torch.device("cpu"), groups, "32-true", None, [optimizer], None)
    finally:
        sys.setprofile(None)
    dist.destroy_process_group()
    return stops, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print every stop, and the stops per file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stops, calls = measure()
    files = len(set(stops))
    print(f"wrap_model: {len(stops)} stops in {files} files, {len(stops) - files} returns, {calls} calls")
    if args.list:
        print(" -> ".join(stops))
        for name, count in Counter(stops).most_common():
            print(f"{count:4d}  {name}")


if __name__ == "__main__":
    main()
