"""Shared fixtures: multi-process scenarios run as scripts, one process per rank, several jobs per launch."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest
import torch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

TRAIN_SCRIPT = TESTS / "scenarios" / "train.py"

from scenarios.config import Config, Scenario  # noqa: E402
from scenarios.jobs import MARK, error_file, job_spec  # noqa: E402


#: Variables that would make a script think it is a rank started by a launcher or a cluster, and their prefixes.
LAUNCHER_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT",
)  # fmt: skip
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_")


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a run's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or cluster's variables, unbuffered, quiet about
    deprecations, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::FutureWarning,ignore::DeprecationWarning", **extra)
    return env


#: How the ranks of a multi-process run are started (see :func:`run_script`).
LAUNCHERS = ("env", "torchrun", "lightning")


def run_script(
    args: list[str],
    cwd: Path,
    timeout: float = 300,
    expect_ok: bool = True,
    package: str = "pytorch_lightning",
    ranks: int = 1,
    nodes: int = 1,
    launcher: str = "env",
) -> subprocess.CompletedProcess:
    """Run a Python script in its own session; whatever it started (the other ranks) is killed when it ends.

    Scenarios run with the Lightning ``package`` given (``scenarios/flavor.py``): ``"pytorch_lightning"`` or
    ``"lightning"``. With ``ranks=1`` the script starts alone and Lightning's launcher starts the other ranks when
    the run begins (as a user's script does). With ``ranks > 1`` the ``launcher`` starts them, in ``nodes``
    simulated nodes of consecutive ranks, all on this machine:

    * ``"env"``: all ranks start together, each told its rank by the environment variables a cluster launcher sets
      (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``...), and Lightning launches nothing: the ranks import torch and
      Lightning in parallel instead of one after the other, which halves a launch (~6 s instead of ~10 s on 2 cores).
    * ``"torchrun"``: one ``torchrun --nnodes N --nproc-per-node M --node-rank n`` per node, with a shared
      ``--master-addr``/``--master-port`` (as on a cluster; Lightning sees ``TorchElasticEnvironment``).
    * ``"lightning"``: one process per node, told only ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, as
      Lightning's documentation starts a multi-node run by hand: the Trainer's (or Fabric's) own launcher starts the
      node's other ranks.

    The output is every started process's, in order; the return code the first non-zero one.
    """
    env = clean_env(TEST_LIGHTNING_PACKAGE=package)
    command = [sys.executable, *args]
    # The scenario scripts and the examples only (not a script that checks what a fresh process imports); torchrun
    # starts its own processes.
    if FORK_SERVER and launcher != "torchrun" and Path(args[0]).parent in FORKED_SCRIPTS:
        return _forked_run(command, cwd, env, ranks, nodes, launcher, timeout, expect_ok)
    processes, outputs = [], []
    try:
        for start, start_env in _starts(command, env, ranks, nodes, launcher):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            outputs.append((out, err))
            processes.append(
                subprocess.Popen(
                    start, cwd=cwd, env=start_env, stdout=out, stderr=err, text=True, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
    else:
        timed_out = False
    finally:
        # A rank left behind (its peer was killed) must not outlive the test, holding ports and CPU.
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    stdout, stderr = [], []
    for out, err in outputs:
        for stream, texts in ((out, stdout), (err, stderr)):
            stream.seek(0)
            texts.append(stream.read())
            stream.close()
    codes = [p.returncode for p in processes]
    return _outcome(command, codes, "".join(stdout), "".join(stderr), timed_out, timeout, expect_ok)


def _outcome(
    command: list[str], codes: list[Any], stdout: str, stderr: str, timed_out: bool, timeout: float, expect_ok: bool
) -> subprocess.CompletedProcess:
    """A launch's processes as one: the output of each in order, the first non-zero exit code; an error if it did
    not end in time, or (``expect_ok``) failed."""
    code = next((c for c in codes if c != 0), 0)
    if timed_out:
        raise AssertionError(f"{command[1:]} did not end within {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    if expect_ok and code != 0:
        raise AssertionError(f"{command[1:]} exited with {codes}:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(command, code, stdout, stderr)


#: Whether the processes of the scenario scripts and examples are forked from a server that imported torch and
#: Lightning once (``tests/forkserver.py``); ``LF_TESTS_FORK_SERVER=0`` starts each with ``subprocess.Popen`` instead.
FORK_SERVER = os.environ.get("LF_TESTS_FORK_SERVER", "1") != "0"
#: The folders of the scripts whose processes the server forks.
FORKED_SCRIPTS = (TESTS / "scenarios", TESTS.parent / "examples")
#: How many fork servers per Lightning package: a launch's i-th process comes from server ``i % SLOTS``, each started
#: with its own ``PYTHONHASHSEED``, so that the ranks of a launch order sets of strings differently, as fresh
#: processes do (code that runs collectives in a set's order would hang on a real launch).
SLOTS = 2
_SERVERS: dict[tuple[str, int], tuple[subprocess.Popen, str]] = {}


def _start_server(package: str, slot: int) -> None:
    """Start a fork server for ``package`` (its imports take ~5 s), without waiting for it."""
    path = os.path.join(tempfile.mkdtemp(prefix="lf-forkserver-"), "socket")
    seed = str(secrets.randbelow(2**32 - 1) + 1)
    server = subprocess.Popen(
        [sys.executable, str(TESTS / "forkserver.py"), path], cwd=TESTS, stdin=subprocess.DEVNULL,
        env=clean_env(TEST_LIGHTNING_PACKAGE=package, PYTHONHASHSEED=seed), start_new_session=True,
    )  # fmt: skip
    _SERVERS[package, slot] = (server, path)


def _fork_server(package: str, slot: int) -> str:
    """The socket of fork server ``slot`` for ``package`` (started here unless the session started it already)."""
    if (package, slot) not in _SERVERS or _SERVERS[package, slot][0].poll() is not None:
        _start_server(package, slot)
    server, path = _SERVERS[package, slot]
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fork server did not start (exit code {server.poll()})")
        time.sleep(0.05)
    return path


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the fork servers while pytest collects, unless only in-process tests were asked for."""
    in_process = (TESTS / "unit", TESTS.parent / "src")
    asked = [Path(arg.split("::")[0]).resolve() for arg in session.config.args]
    if FORK_SERVER and not all(any(path.is_relative_to(p) for p in in_process) for path in asked):
        for slot in range(SLOTS):
            _start_server("pytorch_lightning", slot)


def pytest_sessionfinish() -> None:
    for server, path in _SERVERS.values():
        server.kill()
        server.wait()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


class _Forked:
    """One process forked by a server, over a connection of its own: ``started`` once, then its exit code."""

    def __init__(self, server: str, request: dict[str, Any]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.buffer, self.pid, self.code = b"", 0, None
        self.sock.connect(server)
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        self.pid = self._message(60)["started"]

    def _message(self, wait: float) -> dict[str, Any]:
        self.sock.settimeout(max(wait, 0.01))
        while b"\n" not in self.buffer:
            data = self.sock.recv(1 << 16)  # a timeout raises
            if not data:
                raise AssertionError(f"the fork server ended while process {self.pid or '?'} ran")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def read_exit(self) -> None:
        self.code = self._message(1)["code"]

    def kill(self) -> None:
        """SIGKILL its process group: it and whatever it started (its own session)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)


def _forked_run(
    command: list[str], cwd: Path, env: dict[str, str], ranks: int, nodes: int, launcher: str, timeout: float,
    expect_ok: bool,
) -> subprocess.CompletedProcess:
    """:func:`run_script`, each process it starts forked by a fork server (``tests/forkserver.py``); the ranks
    Lightning's launcher starts from them are its own ``subprocess`` calls, as in a user's run."""
    folder = Path(tempfile.mkdtemp(prefix="lf-ranks-"))
    starts = _starts(command, env, ranks, nodes, launcher)
    files = [(folder / f"{rank}.out", folder / f"{rank}.err") for rank in range(len(starts))]
    children: list[_Forked] = []
    timed_out = False
    try:
        for slot, ((start, start_env), (out, err)) in enumerate(zip(starts, files)):
            request = {"argv": start[1:], "cwd": str(cwd), "env": start_env, "stdout": str(out), "stderr": str(err)}
            children.append(_Forked(_fork_server(env["TEST_LIGHTNING_PACKAGE"], slot % SLOTS), request))
        deadline = time.monotonic() + timeout
        while any(child.code is None for child in children):
            left = deadline - time.monotonic()
            if left <= 0 and timed_out:
                raise AssertionError(f"{command[1:]}: {[c.pid for c in children]} did not end after SIGKILL")
            if left <= 0:
                timed_out, deadline = True, time.monotonic() + 30
                for child in children:
                    child.kill()
                continue
            running = [child for child in children if child.code is None]
            readable, _, _ = select.select([child.sock for child in running], [], [], left)
            for child in running:
                if child.sock in readable:
                    child.read_exit()
        stdout = "".join(out.read_text() if out.exists() else "" for out, _ in files)
        stderr = "".join(err.read_text() if err.exists() else "" for _, err in files)
    finally:
        # A rank left behind (its peer was killed, the test failed) must not outlive the test, nor what it started.
        for child in children:
            child.kill()
            child.sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    return _outcome(command, [child.code for child in children], stdout, stderr, timed_out, timeout, expect_ok)


def _starts(
    command: list[str], env: dict[str, str], ranks: int, nodes: int, launcher: str
) -> list[tuple[list[str], dict[str, str]]]:
    """The processes :func:`run_script` starts: each one's command line and environment."""
    assert launcher in LAUNCHERS, launcher
    if ranks == 1:
        return [(command, env)]
    per_node = ranks // nodes
    address = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if launcher == "torchrun":
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
            "--master-addr", address["MASTER_ADDR"], "--master-port", address["MASTER_PORT"],
        ]  # fmt: skip
        return [([*torchrun, "--node-rank", str(node), *command[1:]], env) for node in range(nodes)]
    if launcher == "lightning":
        return [(command, {**env, **address, "NODE_RANK": str(node)}) for node in range(nodes)]
    starts = []
    for rank in range(ranks):
        rank_env = {**env, **address, "NODE_RANK": "0", "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank % per_node)}
        if nodes > 1:
            rank_env.update(NODE_RANK=str(rank // per_node), LOCAL_WORLD_SIZE=str(per_node))
        starts.append((command, rank_env))
    return starts


def command(config: Config, out: Path, script: Path = TRAIN_SCRIPT) -> list[str]:
    """The arguments that run one scenario script with ``config`` and write the result to ``out``."""
    return [str(script), "--config", json.dumps(config.to_json()), "--out", str(out)]


@dataclass
class Jobs:
    """What one launch of ``scenarios/train.py --jobs`` left: each job's result (its result file, rank 0's), the errors
    every rank recorded for the jobs expected to fail, and the output."""

    folder: Path
    names: list[str]
    proc: subprocess.CompletedProcess

    def __getitem__(self, name: str) -> dict[str, Any]:
        result = self.folder / f"{name}.pt"
        if not result.exists():
            failed = error_file(str(result), 0)
            if failed.exists():  # a job allowed to fail, which did
                raise AssertionError(f"job {name!r} failed:\n{json.loads(failed.read_text())['traceback']}")
            # A launch that may end early (`may_fail`, `killed`) ended before or in this job.
            raise AssertionError(
                f"job {name!r} left no result (the launch ended with exit code {self.proc.returncode}):\n"
                f"{self.stderr(name)[-6000:] or self.proc.stderr[-6000:]}"
            )
        return torch.load(result, weights_only=False)

    def errors(self, name: str, ranks: int = 2) -> list[dict[str, Any]]:
        """The error each of the ``ranks`` processes recorded for the failing job ``name`` (every one must have)."""
        records = []
        for rank in range(ranks):
            path = error_file(str(self.folder / f"{name}.pt"), rank)
            assert path.exists(), f"rank {rank} did not fail in job {name!r}:\n{self.stderr(name)[-4000:]}"
            records.append(json.loads(path.read_text()))
        return records

    def stderr(self, name: str) -> str:
        """What the job printed to standard error, on every rank."""
        return _section(self.proc.stderr, name)

    def output(self, name: str) -> str:
        """What the job printed to standard output and error, on every rank."""
        return _section(self.proc.stdout, name) + _section(self.proc.stderr, name)


def _section(output: str, name: str) -> str:
    chunks = output.split(MARK)
    return "".join(chunk.partition("\n")[2] for chunk in chunks[1:] if chunk.partition("\n")[0] == name)


def run_jobs(
    folder: Path,
    jobs: dict[str, Config],
    failing: Sequence[str] = (),
    package: str = "pytorch_lightning",
    script: Path | None = None,
    nodes: int = 1,
    launcher: str = "env",
    killed: Optional[str] = None,
    may_fail: Sequence[str] = (),
    timeout: float = 300,
) -> Jobs:
    """Run ``scenarios/train.py`` (or ``script``) once for every job (name -> its ``Scenario``, or the
    ``FabricScenario`` of ``fabric_train.py``), one after another in one launch.

    Every job trains on the same number of processes (its ``devices``). The jobs named in ``failing`` must fail
    on every rank; the others must succeed. See ``scenarios/jobs.py``; a ``FabricScenario`` job runs Fabric's loop in
    the same processes. With ``nodes`` the processes are that many simulated nodes of ``devices`` processes each,
    started by ``launcher`` (see :func:`run_script`).

    ``killed``: the last job, in which a process is killed (its ``kill``), so that it needs no launch of its own:
    the launch may fail there, after every other job did what it should (the killed job's test checks how it ended).

    ``may_fail``: jobs whose error is recorded and the launch goes on, in a launch of one process only (with more,
    the others would wait in the collectives of a rank that left the job); reading such a job's result raises its
    error (:class:`Jobs`). Such a launch may also end early (a crash): the jobs done by then keep their results, and
    reading a job that left none raises with what it printed. ``timeout``: for the whole launch, in seconds.
    """
    folder.mkdir(parents=True, exist_ok=True)
    devices = {config.devices for config in jobs.values()}  # type: ignore[attr-defined]
    assert len(devices) == 1, f"one launch trains on one number of processes, not {devices}"
    assert set(failing) <= set(jobs), set(failing) - set(jobs)
    assert killed is None or killed == list(jobs)[-1], f"the killed job {killed!r} ends the launch: put it last"
    (ranks,) = devices
    assert not may_fail or ranks * nodes == 1, "only a launch of one process may go on after a job's error"
    assert set(may_fail) <= set(jobs) and not set(may_fail) & set(failing), (may_fail, failing)
    spec = [
        job_spec(name, config, str(folder / f"{name}.pt"), name in failing, name in may_fail)
        for name, config in jobs.items()
    ]
    path = folder / "jobs.json"
    path.write_text(json.dumps(spec))
    proc = run_script(
        [str(script or TRAIN_SCRIPT), "--jobs", str(path)], cwd=folder, package=package, ranks=ranks * nodes,
        nodes=nodes, launcher=launcher, expect_ok=killed is None and not may_fail, timeout=timeout,
    )
    if killed is not None:  # not ended earlier: every other job left its result
        unfinished = [name for name in jobs if name not in (*failing, killed) and not (folder / f"{name}.pt").exists()]
        assert not unfinished, (
            f"the launch ended before the killed job {killed!r} (exit code {proc.returncode}); jobs without a"
            f" result: {unfinished}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return Jobs(folder, list(jobs), proc)


@pytest.fixture
def package() -> str:
    """The Lightning package the scenarios run with; tests parametrize it to run against both."""
    return "pytorch_lightning"


@pytest.fixture
def train(tmp_path: Path, package: str) -> Callable[..., dict[str, Any]]:
    """Run ``scenarios/train.py`` with the given ``Scenario`` and return what rank 0 saved."""
    counter = iter(range(1000))

    def _train(config: Scenario) -> dict[str, Any]:
        out = tmp_path / f"result-{next(counter)}.pt"
        run_script(command(config, out), cwd=tmp_path, package=package, ranks=config.devices)
        return torch.load(out, weights_only=False)

    return _train


@pytest.fixture
def train_failing(tmp_path: Path, package: str) -> Callable[..., subprocess.CompletedProcess]:
    """Run ``scenarios/train.py`` with the given ``Scenario`` expecting it to fail; return the finished process.

    Lightning's launcher starts the other ranks: when one is killed, the launcher's rank 0 is what notices.
    """

    def _train(config: Scenario) -> subprocess.CompletedProcess:
        proc = run_script(command(config, tmp_path / "unused.pt"), cwd=tmp_path, expect_ok=False, package=package)
        assert proc.returncode != 0, proc.stdout[-2000:]
        return proc

    return _train


def assert_loads_without_fairscale(path: Path, expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """``RegressionModel.load_from_checkpoint(path)`` in a process where fairscale cannot be imported."""
    torch.save(expected, tmp_path / "expected.pt")
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.modules["fairscale"] = None  # any import of fairscale now fails
            sys.modules["lightning_fairscale"] = None
            sys.path.insert(0, {str(TESTS)!r})
            import torch
            from scenarios.common import RegressionModel, max_difference
            model = RegressionModel.load_from_checkpoint({str(path)!r})
            expected = torch.load({str(tmp_path / "expected.pt")!r})
            assert max_difference(model.state_dict(), expected) == 0.0
            assert not any(name.startswith("fairscale") for name in sys.modules if sys.modules[name] is not None)
            print("loaded without fairscale")
            """
        )
    )
    proc = run_script([str(script)], cwd=tmp_path)
    assert "loaded without fairscale" in proc.stdout


# ------------------------------------------------------------------------------------------------------------------
# Partial loading: a model whose code changed resumes from the old model's checkpoint with strict loading off

#: A run of `PartialModel` (a layer gone, one added) from the checkpoint of step 2 of the old model, two more steps.
#: SGD without momentum: a stateful optimizer's state would not fit the changed parameters (as under plain DDP).
PARTIAL = Scenario(model="partial", optimizer="plain_sgd", steps=4, samples=8, record_loaded=True)


def partial_jobs(source: Path, kind: str) -> dict[str, Scenario]:
    """The old model's 2 steps saved in ``source`` (``kind``: full or sharded); `PartialModel` resumed from it with
    strict loading off (``partial-KIND``), and on (``partial-KIND-strict``, which must fail)."""
    return {
        f"partial-source-{kind}": Scenario(steps=2, samples=8, optimizer="plain_sgd", state_dict_type=kind,
                                           save_ckpt=str(source)),
        f"partial-{kind}": PARTIAL.replace(ckpt_path=str(source), strict_loading=False),
        f"partial-{kind}-strict": PARTIAL.replace(ckpt_path=str(source)),
    }  # fmt: skip


def assert_partial_resume(resumed: dict[str, Any], source: dict[str, Any], warned: Optional[str]) -> None:
    """Resumed with strict loading off: the shared entries as saved, the new layer as initialized (and, in ``warned``,
    a warning naming what did not fit); then two steps of training as plain training does them from there."""
    from scenarios.common import PARTIAL_GONE, PARTIAL_NEW, PartialWrapper, after_partial_load, max_difference
    from scenarios.common import reference_training

    assert max_difference(resumed["loaded"], after_partial_load(source["state_dict"])) == 0.0
    if warned is not None:
        assert warned.count("strict loading off") == 1, warned[-3000:]  # once, by rank 0
        assert all(key in warned for key in [*PARTIAL_NEW, *PARTIAL_GONE]), warned[-3000:]
    assert resumed["global_step"] == 4 and len(resumed["losses"]) == 2
    expected = reference_training(2, "plain_sgd", num_samples=8, start=resumed["loaded"], model=PartialWrapper())
    assert max_difference(resumed["state_dict"], expected) < 1e-5
    assert max_difference(resumed["state_dict"], resumed["loaded"]) > 1e-3  # it trained


def assert_strict_refusal(errors: list[dict[str, Any]]) -> None:
    """Every rank refused the changed model before training, naming the keys and `strict_loading`."""
    for error in errors:
        message = error["message"]
        assert "missing keys [extra.weight, extra.bias]" in message, error["traceback"][-3000:]
        assert "unexpected keys [net.1.norm.weight, net.1.norm.bias]" in message
        assert "strict_loading = False" in message
        assert error["trained_batches"] in (0, None)
