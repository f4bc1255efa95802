"""The example scripts in ``examples/`` run, each as its own process, and do what they say.

``demo.py`` is what ``make demo`` runs; ``docs_*.py`` are the examples of the original extension's documentation
page (``shared/seeds/000_*.md``). Each script trains with two processes (Lightning's launcher runs the script again
for rank 1), as a user runs it; its first process is forked by the tests' server, which has imported torch and
Lightning already (``tests/forkserver.py``), and the rank it starts imports them as a user's does. Two examples run
at a time: a launch keeps about one core busy, so on 2 cores two launches take little longer than one.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import math
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import run_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CUDA = torch.cuda.is_available()


class Run:
    """The outcome of one example script."""

    def __init__(self, name: str, cwd: Path, returncode: int, stdout: str, stderr: str) -> None:
        self.name, self.cwd, self.returncode, self.stdout, self.stderr = name, cwd, returncode, stdout, stderr

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        return (
            f"{self.name} exited with {self.returncode}\n"
            f"--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"
        )

    def assert_ok(self) -> None:
        """Exit status 0, and no rank crashed (rank 1's exit status does not reach rank 0's)."""
        assert self.returncode == 0, self.describe()
        for sign in ("Traceback (most recent call last)", "terminate called"):
            assert sign not in self.output, self.describe()

    def checkpoints(self) -> list[Path]:
        return sorted(self.cwd.glob("lightning_logs/version_*/checkpoints/*.ckpt"))


#: Every example script, and how long it may take (seconds, two examples running at a time on 2 cores).
TIMEOUTS = {
    "demo.py": 180, "docs_auto_wrap.py": 150, "docs_manual_wrap.py": 150, "docs_cpu_offload.py": 150,
    "docs_activation_checkpointing.py": 150, "sharded_checkpoint.py": 180, "mixed_precision.py": 150,
    "sharded_ddp.py": 150, "multi_node.py": 240, "fabric_fsdp.py": 240,
}  # fmt: skip


def _run_script(name: str, cwd: Path, timeout: float) -> Run:
    """Run the example as a user does (``python examples/NAME``): its first process forked by the tests' server
    (``tests/forkserver.py``: the script runs as ``__main__`` of a process of its own), whatever it starts (Lightning's
    launcher's ranks, torchrun) started by it as in a user's run; everything it started is killed when it ends."""
    try:
        proc = run_script([str(EXAMPLES / name)], cwd=cwd, timeout=timeout, expect_ok=False)
    except AssertionError as timed_out:  # run_script's message holds the output
        return Run(name, cwd, -signal.SIGKILL, "", f"{timed_out}\n{name} did not finish in {timeout} s")
    return Run(name, cwd, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def run_example(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """The run of an example (each in a fresh folder, where Lightning writes its logs and checkpoints). The first
    call runs every example of :data:`TIMEOUTS`, two at a time."""
    runs: dict[str, Run] = {}

    def run(name: str) -> Run:
        if not runs:
            with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                futures = {
                    script: pool.submit(_run_script, script, tmp_path_factory.mktemp(Path(script).stem), timeout)
                    for script, timeout in TIMEOUTS.items()
                }
                runs.update({script: future.result() for script, future in futures.items()})
        return runs[name]

    return run


def test_every_example_is_run() -> None:
    assert sorted(TIMEOUTS) == sorted(p.name for p in EXAMPLES.glob("*.py"))


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------------
# make demo

_LOSS = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.]+)$", re.MULTILINE)
_SHARDS = re.compile(
    r"^\[rank (\d+)/(\d+)\] FSDP units: (\d+); local parameter shards: (\d+) bytes, unsharded model: (\d+) bytes",
    re.MULTILINE,
)


#: A warning line (``path:line: Category: message``) located in torch.distributed, FairScale or this package.
_WARNING = re.compile(
    r"^(?P<path>\S*(?:/torch/distributed/|/fairscale/|/lightning_fairscale/)\S*):\d+: (?P<category>\w+): (?P<text>.*)$",
    re.MULTILINE,
)


def deprecation_warnings(output: str) -> list[str]:
    """The deprecation warnings among ``output``'s lines that torch.distributed, FairScale or lightning-fairscale
    raised: a ``FutureWarning`` or ``DeprecationWarning``, or any warning saying "deprecated" (torch's
    ``TypedStorage`` one is a ``UserWarning``)."""
    return [
        m.group(0)
        for m in _WARNING.finditer(output)
        if m["category"] in ("FutureWarning", "DeprecationWarning") or "deprecat" in m["text"].lower()
    ]


def test_deprecation_warnings_finds_the_lines_torch_printed() -> None:
    """The lines the demo printed before issue 36 (FairScale's calls and ours, on torch 2.13) are found; others not."""
    site = "/venv/lib/python3.11/site-packages"
    printed = (
        f"{site}/torch/distributed/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_tensor` is"
        " deprecated. Please use `torch.distributed.all_gather_single` instead.\n  return func(*args, **kwargs)\n"
        f"{site}/fairscale/nn/data_parallel/fully_sharded_data_parallel.py:2562: UserWarning: TypedStorage is"
        " deprecated. It will be removed in the future\n  if data.storage().size() > 0:\n"
        f"{site}/pytorch_lightning/trainer/connectors/data_connector.py:425: PossibleUserWarning: few workers\n"
        f"{site}/fairscale/nn/misc.py:10: UserWarning: something else\n"
    )
    found = deprecation_warnings(printed)
    assert len(found) == 2 and "c10d_logger" in found[0] and "TypedStorage" in found[1], found


def test_demo_trains_and_shards(run_example: Callable[[str], Run]) -> None:
    run = run_example("demo.py")
    run.assert_ok()
    # Issue 36: a plain run's console has no deprecation warning of torch.distributed's, FairScale's or ours.
    assert deprecation_warnings(run.output) == [], run.describe()
    assert "done" in run.stdout, run.describe()

    losses = [(int(step), float(loss)) for step, loss in _LOSS.findall(run.stdout)]
    assert len(losses) >= 3, run.describe()
    assert losses[0][0] == 1 and losses[-1][0] == 30, losses
    first, last = losses[0][1], losses[-1][1]
    assert abs(first - math.log(64)) < 1.0, losses  # an untrained model: about uniform over the vocabulary
    assert last < 0.6 * first, losses  # and it learns

    shards = {int(rank): tuple(map(int, rest)) for rank, *rest in _SHARDS.findall(run.stdout)}
    world_size = 2 if not CUDA else min(2, torch.cuda.device_count())
    assert sorted(shards) == list(range(world_size)), run.describe()
    for rank, (world, units, local, full) in shards.items():
        assert world == world_size
        assert units == 3 + 1, "one unit per Block, plus the root"
        # Each unit's flat parameter is padded to a multiple of the world size: at most one element more per unit.
        assert abs(local - full / world) <= units * 4, (rank, local, full)


# ----------------------------------------------------------------------------------------------------------------
# The documentation page's examples

_BORING_KEYS = {"layer.weight", "layer.bias"}
_AMP = "Automatic Mixed Precision (AMP)"  # Lightning's notice: "Using bfloat16 ..." on CPU, "Using 16bit ..." on GPU
DOCS = [
    pytest.param(
        "docs_auto_wrap.py", r"OK strategy=DDPFullyShardedStrategy global_step=4", _BORING_KEYS, True, id="auto_wrap"
    ),
    pytest.param("docs_manual_wrap.py", r"OK fsdp_units=4 global_step=4", None, True, id="manual_wrap"),
    pytest.param("docs_cpu_offload.py", r"OK cpu_offload=True global_step=4", _BORING_KEYS, False, id="cpu_offload"),
    pytest.param(
        "docs_activation_checkpointing.py",
        r"OK global_step=4 block_calls=\d+",
        None,
        False,
        id="activation_checkpointing",
    ),
]


@pytest.mark.parametrize(("script", "expected", "checkpoint_keys", "mixed_precision"), DOCS)
def test_docs_example(
    run_example: Callable[[str], Run], script: str, expected: str, checkpoint_keys, mixed_precision: bool
) -> None:
    run = run_example(script)
    run.assert_ok()
    assert re.search(expected, run.stdout), run.describe()
    assert (_AMP in run.output) == mixed_precision, run.describe()  # `precision=16` as in the doc
    if checkpoint_keys is not None:  # the Trainer's default ModelCheckpoint saved the full, unwrapped state dict
        checkpoints = run.checkpoints()
        assert len(checkpoints) == 1, run.describe()
        state_dict = torch.load(checkpoints[0], map_location="cpu", weights_only=False)["state_dict"]
        assert set(state_dict) == checkpoint_keys
        assert all(v.dtype == torch.float32 for v in state_dict.values())  # the FP32 parameters, also under AMP


@pytest.mark.skipif(CUDA, reason="cpu_offload is honoured on GPUs")
def test_docs_cpu_offload_warns_on_cpu(run_example: Callable[[str], Run]) -> None:
    run = run_example("docs_cpu_offload.py")
    run.assert_ok()
    assert "`DDPFullyShardedStrategy(cpu_offload=True)` has no effect when training on the CPU" in run.stderr


def test_docs_manual_wrap_checkpoint_loads_into_the_model(run_example: Callable[[str], Run]) -> None:
    run = run_example("docs_manual_wrap.py")
    run.assert_ok()
    checkpoints = run.checkpoints()
    assert len(checkpoints) == 1, run.describe()
    state_dict = torch.load(checkpoints[0], map_location="cpu", weights_only=False)["state_dict"]
    model = _load_example("docs_manual_wrap.py").MyModel()
    model.configure_sharded_model()  # outside the strategy, `wrap` is a no-op
    model.load_state_dict(state_dict, strict=True)


def test_sharded_checkpoint_example_resumes_and_consolidates(run_example: Callable[[str], Run]) -> None:
    run = run_example("sharded_checkpoint.py")
    run.assert_ok()
    assert "['meta.pt', 'shard-00000-of-00002.pt', 'shard-00001-of-00002.pt']" in run.stdout, run.describe()
    assert "OK resumed to global_step=12; consolidated BoringModel" in run.stdout, run.describe()
    full = torch.load(run.cwd / "last-full.ckpt", map_location="cpu", weights_only=False)
    assert full["global_step"] == 12 and set(full["state_dict"]) == {"layer.weight", "layer.bias"}


def test_mixed_precision_example_computes_in_low_precision(run_example: Callable[[str], Run]) -> None:
    run = run_example("mixed_precision.py")
    run.assert_ok()
    low = "torch.float16" if CUDA else "torch.bfloat16"
    assert f"computed in ['{low}']; FP32 weights kept: torch.float32" in run.stdout, run.describe()


def test_sharded_ddp_example_splits_the_optimizer(run_example: Callable[[str], Run]) -> None:
    run = run_example("sharded_ddp.py")
    run.assert_ok()
    for rank in (0, 1):  # BoringModel has a weight and a bias: one each
        assert f"rank {rank}: OSS updates 1 of 2 parameters" in run.stdout, run.describe()
    assert "OK strategy=DDPShardedStrategy global_step=4" in run.stdout, run.describe()


def test_multi_node_example_runs_two_torchrun_nodes(run_example: Callable[[str], Run]) -> None:
    run = run_example("multi_node.py")
    run.assert_ok()
    for node in (0, 1):
        assert f"OK node {node} rank {node} of 2 (TorchElasticEnvironment)" in run.stdout, run.describe()


def test_fabric_fsdp_example_trains_and_resumes_exactly(run_example: Callable[[str], Run]) -> None:
    run = run_example("fabric_fsdp.py")
    run.assert_ok()
    assert "FSDP units: 3" in run.stdout, run.describe()  # each Block, plus the root
    losses = [(int(step), float(loss)) for step, loss in _LOSS.findall(run.stdout)]
    assert [step for step, _ in losses] == [*range(1, 9), *range(5, 9)], run.describe()  # the second half, again
    assert losses[7][1] < 0.7 * losses[0][1], losses  # it learns
    assert losses[8:] == losses[4:8]  # the same losses after loading the checkpoint of step 4
    assert "OK resumed at step 4: the last 4 losses are the same" in run.stdout, run.describe()
    checkpoint = run.cwd / "fabric-checkpoint"  # sharded: one file per rank, as the Trainer's strategy writes them
    names = ["meta.pt", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    assert sorted(p.name for p in checkpoint.iterdir()) == names


@pytest.mark.parametrize("script", sorted(TIMEOUTS))
def test_no_example_prints_a_deprecation_warning_of_ours(run_example: Callable[[str], Run], script: str) -> None:
    """Every example's console (the runs above, not more): no deprecation warning of torch.distributed's, FairScale's
    or ours (issue 36)."""
    assert deprecation_warnings(run_example(script).output) == [], run_example(script).describe()
