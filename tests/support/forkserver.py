"""The tests' `python -m ckptconv` and `torchrun`, without paying torch's import (about 2.4 s of CPU) in
every process that starts them.

Run as a script, this is a zygote: it imports torch, `ckptconv.cli` and `torch.distributed.run` once (never
running a torch op, so no thread pool exists to break across a fork), then forks one child per command. The
child is a fresh copy of that process, with nothing of an earlier command: it takes the command's working
directory and environment, stdin on /dev/null, stdout and stderr into files, and runs the module as
`python -m MODULE ARGV...` would (`runpy`, as `-m` does): `ckptconv`, whose entry point exits with the
command's code, or `torch.distributed.run`, torchrun's own launcher, which starts its workers as new
interpreters as always. Imported, `ForkServer.run(module, argv, env, timeout)` is the client: it returns what
`subprocess.run(capture_output=True, text=True)` would.

Protocol, one JSON object per line: the client sends {"module", "argv", "cwd", "env", "stdout", "stderr"};
the zygote answers {"pid"} at once (commands may run concurrently) and {"exit": pid, "code"} when that child
ends.
"""

from __future__ import annotations

import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any


def _serve(requests: int, replies: int) -> None:
    pending = b""

    def reply(doc: dict[str, Any]) -> None:
        os.write(replies, json.dumps(doc).encode() + b"\n")

    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        while True:  # reap the children that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(requests, 1 << 20)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _child(json.loads(line), requests, replies)
            reply({"pid": pid})


def _child(request: dict[str, Any], *protocol: int) -> None:
    code = 1
    try:
        for fd in protocol:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            new = os.open(path, flags, 0o600)
            os.dup2(new, fd)
            os.close(new)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                sys.stderr.write(e.code + "\n")
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never return into the zygote's loop


class ForkServer:
    """A zygote for this process's tests (started on first use, ended with the process)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._send = threading.Lock()
        self._pids: queue.Queue[int] = queue.Queue()
        self._codes: dict[int, int] = {}
        self._ended = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            doc = json.loads(line)
            if "pid" in doc:
                self._pids.put(doc["pid"])
                continue
            with self._ended:
                self._codes[doc["exit"]] = doc["code"]
                self._ended.notify_all()

    def run(
        self, module: str, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        out, err = (tempfile.mkstemp(prefix=f"ckptconv-forkserver-{name}-") for name in ("out", "err"))
        try:
            os.close(out[0])
            os.close(err[0])
            request = {"module": module, "argv": argv, "cwd": os.getcwd(), "env": env}
            request.update(stdout=out[1], stderr=err[1])
            assert self._proc.stdin is not None
            with self._send:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                pid = self._pids.get(timeout=60)
            with self._ended:
                if not self._ended.wait_for(lambda: pid in self._codes, timeout=timeout):
                    os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired([sys.executable, "-m", module, *argv], timeout)
                code = self._codes.pop(pid)
            stdout, stderr = (Path(p).read_text() for p in (out[1], err[1]))
        finally:
            for _, path in (out, err):
                os.unlink(path)
        return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], code, stdout, stderr)


if __name__ == "__main__":
    import torch.distributed.run  # noqa: F401  (torch: the import every command would pay)

    import ckptconv.cli.app  # noqa: F401

    requests_fd, replies_fd = os.dup(0), os.dup(1)
    for fd, flags in ((0, os.O_RDONLY), (1, os.O_WRONLY)):
        devnull = os.open(os.devnull, flags)
        os.dup2(devnull, fd)
        os.close(devnull)
    _serve(requests_fd, replies_fd)
