"""Ranks started by forking a process that has already imported torch, Lightning and FairScale.

A rank of a scenario spends ~5 s of CPU importing torch, Lightning, FairScale and this package before it trains for a
second or two, and the suite starts ~100 of them. This server imports them once (with the environment every rank
gets, :func:`conftest.clean_env`), then forks one child per rank that :func:`conftest.run_script` asks for. A child
is a real, separate process, as a cluster launcher's rank is: its own session, working directory, environment
(the launcher's variables: ``MASTER_PORT``, ``LOCAL_RANK``...), standard streams and ``sys.argv``; it runs the script
as ``__main__`` and ends as a script ends (``atexit`` handlers, exit status, a traceback for an uncaught exception).
What it shares with the others is only what importing left in memory, which a fresh process would rebuild the same
way. Lightning's ``"ddp_fork"`` starts its ranks the same way.

Used for the scenario scripts (``tests/scenarios/*.py``), under every launcher but torchrun (which starts its processes
itself); the ranks Lightning's launcher starts from a forked process are its own ``subprocess`` calls, as in a user's
run. A script that checks what a fresh process imports is started with ``subprocess.Popen``, as before.
``LF_TESTS_FORK_SERVER=0`` turns it off (every rank then starts with ``subprocess.Popen``).

Protocol, one JSON object per line over a Unix socket, one connection per process: a request ``{"argv", "cwd", "env",
"stdout", "stderr"}`` answered by ``{"started": pid}``, and later ``{"pid": pid, "code": exit code}`` (negative: the
signal that ended it). ``conftest`` runs two servers per Lightning package, each with its own ``PYTHONHASHSEED``, and
sends a launch's processes to them in turn: its ranks order sets of strings differently, as fresh processes do.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import runpy
import select
import socket
import sys
from typing import Any

#: What every rank imports before it does anything else (the scenario scripts' own modules are cheap).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp.wrap", "fairscale", "lightning_fairscale")


def _child(request: dict[str, Any]) -> None:
    """Become the requested process: run its script as ``__main__``, then leave the interpreter as a script does."""
    os.setsid()  # its own session: the test kills the whole group on a timeout
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, fd)
        os.close(out)
    random.seed()  # a fresh process's Python RNG, not the server's copied state
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)  # the interpreter's normal exit, unwinding the server's frames (nothing catches it)


def serve(path: str) -> None:
    """Accept requests on the Unix socket ``path`` until the parent (the test session) is gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    importlib.import_module(os.environ.get("TEST_LIGHTNING_PACKAGE", "pytorch_lightning"))
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen()
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    buffers: dict[socket.socket, bytes] = {}
    owners: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([server, *buffers], [], [], 0.05)
        for sock in readable:
            if sock is server:
                buffers[sock.accept()[0]] = b""
                continue
            data = sock.recv(1 << 16)
            if not data:
                del buffers[sock]
                sock.close()
                continue
            buffers[sock] += data
            while b"\n" in buffers[sock]:
                line, buffers[sock] = buffers[sock].split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    server.close()
                    for other in buffers:
                        other.close()
                    _child(json.loads(line))
                owners[pid] = sock
                _send(sock, {"started": pid}, buffers)
        while owners:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            owner = owners.pop(pid)
            if owner in buffers:
                _send(owner, {"pid": pid, "code": os.waitstatus_to_exitcode(status)}, buffers)


def _send(sock: socket.socket, message: dict[str, Any], buffers: dict[socket.socket, bytes]) -> None:
    """Answer a client; one that is gone (its test failed or was interrupted) is forgotten, the server goes on."""
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        buffers.pop(sock, None)
        sock.close()


if __name__ == "__main__":
    serve(sys.argv[1])
