"""Reliability: multi-node launches, lost ranks, damaged checkpoints, misconfiguration and determinism.

Every case runs real processes; the launchers are torchrun (TorchElastic) and SLURM-style environment variables,
both on localhost, with two "nodes" of one process each.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from scenarios.common import assert_adam_close, max_difference, reference_training
from scenarios.config import Lose, Scenario

from conftest import Jobs, clean_env, command, free_port, run_jobs

ATOL = 1e-5


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float = 240) -> list[str]:
    """Start one process per "node", wait for all, and return their outputs; fail if any exits non-zero."""
    logs = [cwd / f"node-{i}.log" for i in range(len(commands))]
    processes = []
    for (arguments, env), log in zip(commands, logs):
        with open(log, "w") as out:
            processes.append(
                subprocess.Popen(
                    arguments, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        codes = [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    outputs = [log.read_text() for log in logs]
    for code, output in zip(codes, outputs):
        assert code == 0, output[-6000:]
    return outputs


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_nodes_equal_the_unsharded_reference(tmp_path: Path, launcher: str) -> None:
    out = tmp_path / "result.pt"
    script = command(Scenario(devices=1, num_nodes=2, steps=3), out)
    port = str(free_port())
    commands = []
    for node in range(2):
        if launcher == "torchrun":
            arguments = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port, *script,
            ]  # fmt: skip
            env = clean_env()
        else:
            arguments = [sys.executable, *script]
            env = clean_env(
                SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(node), SLURM_LOCALID="0",
                SLURM_NODEID=str(node), SLURM_JOB_ID="4242", SLURM_JOB_NAME="fsdp-test", SLURM_NODELIST="127.0.0.1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            )  # fmt: skip
        commands.append((arguments, env))
    outputs = _run_nodes(commands, tmp_path)
    environment = "TorchElasticEnvironment" if launcher == "torchrun" else "SLURMEnvironment"
    assert all(f"cluster={environment}" in output for output in outputs), outputs[0][-3000:]
    result = torch.load(out, weights_only=False)
    assert result["world_size"] == 2 and result["num_nodes"] == 2
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


#: How long a run may take to end after it lost a rank, beyond the collective timeout that a stuck rank makes the
#: others wait (``Scenario.timeout``): naming the lost ranks (a 2 s wait on the store), stopping the node's other
#: processes and their exit. Measured from the loss, not from the start: start-up time depends on the machine's load.
AFTER_TIMEOUT_S = 30


#: The ranks lost, how, and what the run must say: rank 0 names the exited child at once; Lightning's launcher watchdog
#: (a 5 s poll) may still win the race and SIGKILL the node first, with its own message naming the same rank. Either
#: ends the run, naming rank 1. A stuck rank is not dead: the strategy's `timeout` ends the wait.
LOSSES = {
    "rank1-killed": (
        1, "KILL", r"rank 1 did not answer|\[rank: 1\] Child process with PID \d+ terminated with code -9"
    ),
    "rank1-stuck": (1, "STOP", "rank 1 did not answer"),
    "rank0-killed": (0, "KILL", "rank 0, which hosts the rendezvous store, is gone"),
}
#: The collective timeout of those runs (``Scenario.timeout``).
LOSS_TIMEOUT = 10


def _lose_a_rank(folder: Path, rank: int, how: str) -> tuple[int, str, float, bool]:
    """One run that loses ``rank`` at step 3: its return code, its output, when every one of its processes was gone
    (``time.time()``), and whether any was left behind after 240 s."""
    folder.mkdir()
    log = folder / "run.log"
    # The ranks enter the rendezvous together (scenarios/train.py, start_together): the short timeout bounds it too.
    config = Scenario(steps=50, samples=64, lose=Lose(rank, step=3, how=how), timeout=LOSS_TIMEOUT)
    arguments = [sys.executable, *command(config, folder / "unused.pt")]
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            arguments, cwd=folder, env=clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        process.wait(timeout=240)  # only a guard against a hang: how quickly the run ends is measured by the test
        # Every process of the run must be gone by itself, not only the one we started.
        while time.monotonic() - started < 240 and _group_alive(process.pid):
            time.sleep(0.2)
        ended = time.time()
        survivors = _group_alive(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, log.read_text(), ended, survivors


@pytest.fixture(scope="module")
def lost_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, float, bool]]:
    """The runs of :data:`LOSSES`, all at once: each spends most of its time waiting (for its start, for a lost
    rank), and each is measured from its own loss."""
    folder = tmp_path_factory.mktemp("lost-ranks")
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(LOSSES)) as pool:
        futures = {name: pool.submit(_lose_a_rank, folder / name, rank, how) for name, (rank, how, _) in LOSSES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", LOSSES)
def test_a_lost_rank_ends_the_run_quickly_and_is_named(
    lost_ranks: dict[str, tuple[int, str, float, bool]], name: str
) -> None:
    rank, _, expected = LOSSES[name]
    returncode, output, ended, survivors = lost_ranks[name]
    assert returncode != 0, output[-4000:]
    # The rank was lost in training, so the failure named is the loss's (not, say, a rank that was slow to start).
    lost = re.search(rf"lost rank {rank} at ([0-9]+\.[0-9]+)", output)
    assert lost, output[-4000:]
    assert re.search(expected, output[lost.end() :]), output[-4000:]
    assert not survivors, f"processes of the run were left behind:\n{output[-4000:]}"
    after = ended - float(lost.group(1))
    assert after < LOSS_TIMEOUT + AFTER_TIMEOUT_S, f"the run took {after:.1f} s to end after losing rank {rank}"


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (stopped processes count: they hold resources)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Zombies (exited, not yet reaped by their parent) count as gone.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
    return False


#: Misconfigurations that only show once the model, the optimizer or the Trainer's precision is known. Each must fail
#: before training, on every rank, with a message that says what to do. (Constructor arguments are checked without
#: processes in tests/test_strategy_config.py.)
MISCONFIGURATIONS = [
    (
        Scenario(params="stray"),
        "not part of the LightningModule, so FSDP does not shard or update it. Create the optimizer",
    ),
    (Scenario(compute_dtype="float16"), "needs mixed precision"),
    (Scenario(move_grads_to_cpu=False, cpu_offload=True), "leave `move_grads_to_cpu` unset"),
    (Scenario(ckpt_path="missing.ckpt"), "not found"),
    # Under FSDP, SWA would deep-copy the sharded module (WeightAveraging is the way); refused before any process group.
    (Scenario(callback="swa"), "`StochasticWeightAveraging` does not work with `DDPFullyShardedStrategy`"),
    (Scenario(callback="pruning", devices=1), "`ModelPruning` does not work with `DDPFullyShardedStrategy`"),
]
MISCONFIGURATION_IDS = [m[1][:24] for m in MISCONFIGURATIONS]


def _misconfiguration(index: int) -> str:
    return f"misconfiguration-{index}"


DAMAGED = [
    ("full", "", "truncated", "truncated, corrupt or not a PyTorch checkpoint"),
    ("full", "", "zeroed", "truncated, corrupt or not a PyTorch checkpoint"),
    ("sharded", "shard-00001-of-00002.pt", "truncated", "shard-00001-of-00002.pt: it is truncated"),
    ("sharded", "meta.pt", "zeroed", "meta.pt: it is truncated"),
]
DAMAGED_IDS = ["full-truncated", "full-zeroed", "sharded-one-shard-truncated", "sharded-meta-zeroed"]
KINDS = ["full", "sharded"]
#: A failing job whose ranks wait for each other must not wait for the strategy's collective timeout (30 s).
TIMEOUT = 30


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """One launch of 2 processes: the first of two same-seed runs (the first job, in fresh processes), the
    misconfigurations (failing), a full and a sharded checkpoint of the same two steps, and freezing unflattened."""
    folder = tmp_path_factory.mktemp("first")
    jobs = {"seed": Scenario(steps=3)}
    for index, (config, _) in enumerate(MISCONFIGURATIONS):
        if config.devices == 2:
            jobs[_misconfiguration(index)] = config.replace(timeout=TIMEOUT)
    for kind in KINDS:
        jobs[f"saved-{kind}"] = Scenario(steps=2, samples=8, state_dict_type=kind, checkpoint_dir=str(folder / kind))
    jobs["freeze-unflattened"] = Scenario(freeze=("net.1.up.weight",), flatten=False, steps=2)
    failing = [name for name in jobs if name.startswith("misconfiguration-")]
    return run_jobs(folder, jobs, failing=failing)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """One launch of 1 process: the misconfigurations that only show on one process (failing)."""
    jobs = {
        _misconfiguration(index): config.replace(timeout=TIMEOUT)
        for index, (config, _) in enumerate(MISCONFIGURATIONS)
        if config.devices == 1
    }
    return run_jobs(tmp_path_factory.mktemp("single"), jobs, failing=list(jobs))


def _saved(first: Jobs, kind: str) -> Path:
    return first.folder / kind / "epoch=1-step=2.ckpt"


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\0" * len(data))


@pytest.fixture(scope="module")
def second(first: Jobs, tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """A later launch of 2 processes: the second same-seed run (the first job, in fresh processes), resumes from
    damaged copies of ``first``'s checkpoints and from its checkpoints into another model (all failing)."""
    folder = tmp_path_factory.mktemp("second")
    jobs = {"seed": Scenario(steps=3)}
    for name, (kind, damaged, how, _) in zip(DAMAGED_IDS, DAMAGED):
        copy = folder / f"{name}.ckpt"
        (shutil.copytree if _saved(first, kind).is_dir() else shutil.copy)(_saved(first, kind), copy)
        _damage(copy / damaged if damaged else copy, how)
        jobs[f"damaged-{name}"] = Scenario(steps=4, samples=8, ckpt_path=str(copy), timeout=TIMEOUT)
    for kind in KINDS:
        jobs[f"other-model-{kind}"] = Scenario(steps=4, samples=8, depth=3, ckpt_path=str(_saved(first, kind)),
                                               timeout=TIMEOUT)
    return run_jobs(folder, jobs, failing=[name for name in jobs if name != "seed"])


def _job_seconds(jobs: Jobs, name: str) -> float:
    """How long the job ``name`` took on its slowest rank: from the last file the job before it wrote (its result or
    its error records) to the last error record of this one."""
    before = jobs.names[jobs.names.index(name) - 1]
    ended = max(path.stat().st_mtime for path in jobs.folder.glob(f"{before}.pt*"))
    return max(path.stat().st_mtime for path in jobs.folder.glob(f"{name}.pt.error-rank*.json")) - ended


def test_same_seed_gives_identical_parameters(first: Jobs, second: Jobs) -> None:
    # Two launches: the same seed gives the same parameters in other processes too.
    assert max_difference(first["seed"]["state_dict"], second["seed"]["state_dict"]) == 0.0


@pytest.mark.parametrize(("config", "message"), MISCONFIGURATIONS, ids=MISCONFIGURATION_IDS)
def test_misconfiguration_fails_early_with_a_hint(
    request: pytest.FixtureRequest, config: Scenario, message: str
) -> None:
    processes = config.devices
    runs: Jobs = request.getfixturevalue("first" if processes == 2 else "single")
    name = _misconfiguration(MISCONFIGURATIONS.index((config, message)))
    for error in runs.errors(name, ranks=processes):  # every rank refuses it
        assert message in error["message"], error["traceback"][-4000:]
        assert error["trained_batches"] in (0, None)  # nothing trained


def test_freezing_works_without_flattening(first: Jobs) -> None:
    result = first["freeze-unflattened"]
    reference = reference_training(2, "adam", freeze=["net.1.up.weight"])
    assert_adam_close(result["state_dict"], reference)


@pytest.mark.parametrize(("kind", "damaged", "how", "message"), DAMAGED, ids=DAMAGED_IDS)
def test_a_damaged_checkpoint_fails_every_rank_clearly(
    second: Jobs, kind: str, damaged: str, how: str, message: str
) -> None:
    name = f"damaged-{DAMAGED_IDS[DAMAGED.index((kind, damaged, how, message))]}"
    errors = second.errors(name)
    if kind == "sharded" and damaged.startswith("shard-00001"):
        # Only rank 1 read the damaged shard and names it; rank 0 must know too, and says so.
        assert message in errors[1]["message"], errors[1]["traceback"][-4000:]
        assert "Another process failed to read the sharded checkpoint" in errors[0]["message"], errors[0]["traceback"]
    else:
        for error in errors:
            assert message in error["message"], error["traceback"][-4000:]
    assert all(error["trained_batches"] in (0, None) for error in errors)
    # No rank waited for the collective timeout (30 s) to learn of another's failure.
    assert _job_seconds(second, name) < 30


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_of_another_model_is_refused_clearly(second: Jobs, kind: str) -> None:
    for error in second.errors(f"other-model-{kind}"):  # named before anything loads, from either format
        assert "does not fit the model: missing keys [net.3." in error["message"], error["traceback"][-4000:]
        assert "strict_loading = False" in error["message"]
