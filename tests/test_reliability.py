"""Reliability: multi-node launches, lost ranks, damaged checkpoints, misconfiguration and determinism.

Every case runs real processes; the launchers are torchrun (TorchElastic) and SLURM-style environment variables,
both on localhost, with two "nodes" of one process each.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from scenarios.common import max_difference, reference_training

from conftest import TRAIN_SCRIPT, run_script

Train = Callable[..., dict[str, Any]]
TrainFailing = Callable[..., subprocess.CompletedProcess]
ATOL = 1e-5
_LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOBAL_RANK", "RANK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::FutureWarning,ignore::DeprecationWarning", **extra)
    return env


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float = 240) -> list[str]:
    """Start one process per "node", wait for all, and return their outputs; fail if any exits non-zero."""
    logs = [cwd / f"node-{i}.log" for i in range(len(commands))]
    processes = []
    for (command, env), log in zip(commands, logs):
        with open(log, "w") as out:
            processes.append(
                subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
    script = [str(TRAIN_SCRIPT), "--out", str(out), "--devices", "1", "--num-nodes", "2", "--steps", "3"]
    port = str(_free_port())
    commands = []
    for node in range(2):
        if launcher == "torchrun":
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port, *script,
            ]  # fmt: skip
            env = _clean_env()
        else:
            command = [sys.executable, *script]
            env = _clean_env(
                SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(node), SLURM_LOCALID="0",
                SLURM_NODEID=str(node), SLURM_JOB_ID="4242", SLURM_JOB_NAME="fsdp-test", SLURM_NODELIST="127.0.0.1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            )  # fmt: skip
        commands.append((command, env))
    outputs = _run_nodes(commands, tmp_path)
    environment = "TorchElasticEnvironment" if launcher == "torchrun" else "SLURMEnvironment"
    assert all(f"cluster={environment}" in output for output in outputs), outputs[0][-3000:]
    result = torch.load(out, weights_only=False)
    assert result["world_size"] == 2 and result["num_nodes"] == 2
    assert max_difference(result["state_dict"], reference_training(3, "adam")) < ATOL


@pytest.mark.parametrize(
    ("rank", "how", "expected"),
    [
        # Rank 0 names the exited child at once; Lightning's launcher watchdog (a 5 s poll) may still win the race
        # and SIGKILL the node first, with its own message naming the same rank. Either ends the run, naming rank 1.
        (1, "KILL", r"rank 1 did not answer|\[rank: 1\] Child process with PID \d+ terminated with code -9"),
        (1, "STOP", "rank 1 did not answer"),  # stuck, not dead: the strategy's `timeout` ends the wait
        (0, "KILL", "rank 0, which hosts the rendezvous store, is gone"),
    ],
    ids=["rank1-killed", "rank1-stuck", "rank0-killed"],
)
def test_a_lost_rank_ends_the_run_quickly_and_is_named(tmp_path: Path, rank: int, how: str, expected: str) -> None:
    log = tmp_path / "run.log"
    command = [
        sys.executable, str(TRAIN_SCRIPT), "--out", str(tmp_path / "unused.pt"), "--steps", "50", "--samples", "64",
        "--lose-rank", str(rank), "--lose-at-step", "3", "--lose-how", how, "--timeout", "10",
    ]  # fmt: skip
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=tmp_path, env=_clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        process.wait(timeout=120)
        # Every process of the run must be gone by itself, not only the one we started.
        while time.monotonic() - started < 120 and _group_alive(process.pid):
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        survivors = _group_alive(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert process.returncode != 0, output[-4000:]
    assert re.search(expected, output), output[-4000:]
    assert not survivors, f"processes of the run were left behind:\n{output[-4000:]}"
    assert elapsed < 90, f"the run took {elapsed:.0f} s to end"


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


def test_same_seed_gives_identical_parameters(train: Train) -> None:
    first = train("--steps", "3")
    second = train("--steps", "3")
    assert max_difference(first["state_dict"], second["state_dict"]) == 0.0


#: Misconfigurations that only show once the model, the optimizer or the Trainer's precision is known. Each must fail
#: before training, on every rank, with a message that says what to do. (Constructor arguments are checked without
#: processes in tests/test_strategy_config.py.)
MISCONFIGURATIONS = [
    (("--params", "stray"), "not part of the LightningModule, so FSDP does not shard or update it. Create the optimizer"),
    (("--params", "split"), "split between param groups"),
    (("--freeze", "net.1.up.weight"), "both frozen and trainable parameters"),
    (("--compute-dtype", "float16"), "needs mixed precision"),
    (("--move-grads-to-cpu", "0", "--cpu-offload"), "leave `move_grads_to_cpu` unset"),
    (("--ckpt-path", "missing.ckpt"), "not found"),
    # Under FSDP, SWA would average nothing, silently; it is refused before any process group exists.
    (("--callback", "swa"), "`StochasticWeightAveraging` does not work with `DDPFullyShardedStrategy`"),
    (("--callback", "pruning", "--devices", "1"), "`ModelPruning` does not work with `DDPFullyShardedStrategy`"),
]


@pytest.mark.parametrize(("args", "message"), MISCONFIGURATIONS, ids=[m[1][:24] for m in MISCONFIGURATIONS])
def test_misconfiguration_fails_early_with_a_hint(train_failing: TrainFailing, args: tuple[str, ...], message: str) -> None:
    proc = train_failing(*args, "--timeout", "30")
    assert message in proc.stderr, proc.stderr[-4000:]
    assert "global_step" not in proc.stdout  # nothing trained


def test_freezing_works_without_flattening(train: Train) -> None:
    result = train("--freeze", "net.1.up.weight", "--flatten", "0", "--steps", "2")
    reference = reference_training(2, "adam", freeze="net.1.up.weight")
    assert max_difference(result["state_dict"], reference) < ATOL


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A full and a sharded checkpoint of the same two steps."""
    folder = tmp_path_factory.mktemp("saved")
    paths = {}
    for kind in ("full", "sharded"):
        args = ["--out", str(folder / f"{kind}.pt"), "--steps", "2", "--samples", "8", "--state-dict-type", kind]
        run_script([str(TRAIN_SCRIPT), *args, "--checkpoint-dir", str(folder / kind)], cwd=folder)
        paths[kind] = folder / kind / "epoch=1-step=2.ckpt"
    return paths


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\0" * len(data))


@pytest.mark.parametrize(
    ("kind", "damaged", "how", "message"),
    [
        ("full", "", "truncated", "truncated, corrupt or not a PyTorch checkpoint"),
        ("full", "", "zeroed", "truncated, corrupt or not a PyTorch checkpoint"),
        ("sharded", "shard-00001-of-00002.pt", "truncated", "shard-00001-of-00002.pt: it is truncated"),
        ("sharded", "meta.pt", "zeroed", "meta.pt: it is truncated"),
    ],
    ids=["full-truncated", "full-zeroed", "sharded-one-shard-truncated", "sharded-meta-zeroed"],
)
def test_a_damaged_checkpoint_fails_every_rank_clearly(
    train_failing: TrainFailing, saved: dict[str, Path], tmp_path: Path, kind: str, damaged: str, how: str, message: str
) -> None:
    copy = tmp_path / "copy.ckpt"
    (shutil.copytree if saved[kind].is_dir() else shutil.copy)(saved[kind], copy)
    _damage(copy / damaged if damaged else copy, how)
    started = time.monotonic()
    proc = train_failing("--steps", "4", "--samples", "8", "--ckpt-path", str(copy), "--timeout", "30")
    assert message in proc.stderr, proc.stderr[-4000:]
    if kind == "sharded" and damaged.startswith("shard-00001"):  # only rank 1 read it; rank 0 must know too
        assert "Another process failed to read the sharded checkpoint" in proc.stderr, proc.stderr[-4000:]
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_checkpoint_of_another_model_is_refused_clearly(
    train_failing: TrainFailing, saved: dict[str, Path], kind: str
) -> None:
    proc = train_failing("--steps", "4", "--samples", "8", "--depth", "3", "--ckpt-path", str(saved[kind]))
    expected = "does not fit the model: missing keys [net.3." if kind == "full" else "wrapped differently"
    assert expected in proc.stderr, proc.stderr[-4000:]
