"""The rank fork server: one process per node agent that has imported everything a rank
imports, and forks each rank of the node from that state.

    python -m services.rank.forkserver FD [--module MODULE]   (started by the node agent)

Why: a rank's start is dominated by the interpreter importing torch and the rank's modules
(2-3 s of a core each, 10 s on a loaded 2-core host, measured); every launch and every
replacement in a recovery paid it, and a node launching 8 ranks paid it 8 times at once.
Forked from here a rank starts in milliseconds and shares the imported pages with its peers.
The same pattern as Python's ``multiprocessing`` forkserver, with two things it lacks: the
rank must be the node agent's own child (the agent reaps it, hears its stops and continues
through ``waitid`` and reads its exit code: services/worker/rank_forkserver.py), and its
output must go to the pipe the agent's log pump reads.

Protocol, on the Unix socket ``FD`` (the agent's end of a socketpair): the agent sends one
order, a JSON object ``{"argv": [...], "env": {...}, "cwd": "...", "title": "..."}`` with one
file descriptor attached (the write end of the rank's output pipe); the server answers
``{"pid": N}`` or ``{"error": "..."}``. End of input ends the server (the agent is gone).

How a rank becomes the agent's child: the server forks a child that forks the rank and exits
at once; the rank, orphaned, is adopted by the nearest subreaper among its ancestors, the
node agent (``PR_SET_CHILD_SUBREAPER``), before the server answers.

Fork safety: nothing here starts a thread of its own, opens a channel or touches a device.
``import torch`` starts one native thread that holds no lock a child needs (as for
DataLoader's forked workers); CUDA initialises lazily in the rank, after its environment
(``CUDA_VISIBLE_DEVICES``) is set; torch's thread count is set by the rank from its
assignment; Python's ``random`` reseeds itself in a forked child. The comm guard's modules
imported here (torch.distributed.pipelining, hence torch._dynamo and torch._inductor) start no
thread and make no torch.cuda call while imported (checked on a CPU build: no call of
torch.cuda's device queries or of its lazy init; not yet checked on a CUDA build).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import time

_STARTED = time.perf_counter()

ORDER_BYTES = 1 << 20  # one order: argv, environment, cwd (a large environment is ~100 kB)


def _run_rank(order: dict, out_fd: int, module) -> None:
    """In the forked rank: become the process a fresh ``python -m services.rank ...`` would
    have been (own session, its environment, cwd, output and title), then run its main."""
    os.setsid()  # its own process group: the agent signals the rank with its helpers
    import setproctitle

    # Seen as the rank it is (`ps`, `pkill -f "rank --job J --rank R"`), not as the server.
    # (Before the environment is replaced: setproctitle needs the process's original one.)
    setproctitle.setproctitle(order["title"])
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    for fd in [int(f) for f in os.listdir("/proc/self/fd")]:  # as Popen's close_fds
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass  # (the listing's own descriptor)
    sys.argv = [order["title"].split()[0], *order["argv"]]
    module.main(order["argv"])


def _fork_rank(order: dict, out_fd: int, sock: socket.socket) -> int:
    """Fork the rank through a child that exits at once (the rank is then the agent's:
    module docstring); returns the rank's pid, or 0 in the rank itself."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the intermediate child: fork the rank, tell its pid, leave
        os.close(read)
        try:
            rank = os.fork()
        except OSError:
            os._exit(1)
        if rank == 0:
            os.close(write)
            sock.close()
            return 0
        os.write(write, str(rank).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read()
    os.waitpid(child, 0)  # once it is reaped, the rank has been adopted by the agent
    if not text:
        raise OSError("the fork server's child could not fork the rank")
    return int(text)


def serve(sock: socket.socket) -> tuple[dict, int] | None:
    """Answer orders until the agent closes its end (None). In a forked rank it returns that
    rank's order and output descriptor, for :func:`main` to run it as a program's top level."""
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, ORDER_BYTES, 1)
        if not data:
            return None  # the agent is gone, or stopped this server
        try:
            order = json.loads(data)
            if len(fds) != 1:
                raise ValueError(f"an order carries one output descriptor, not {len(fds)}")
            pid = _fork_rank(order, fds[0], sock)
            if pid == 0:
                return order, fds[0]
            reply = {"pid": pid}
        except (OSError, ValueError, KeyError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps(reply).encode())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.rank.forkserver", description=__doc__.split("\n")[0])
    ap.add_argument("fd", type=int, help="the agent's Unix socket (inherited descriptor)")
    ap.add_argument("--module", default="services.rank.__main__", help="the rank's module (its main(argv) runs)")
    args = ap.parse_args(argv)
    # The imports a rank pays for at start, paid once here.
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    from services.contract.comm_guard import BINDING_MODULES

    for name in BINDING_MODULES:  # what the rank's comm guard imports before its sweep (no thread starts)
        importlib.import_module(name)
    module = importlib.import_module(args.module)
    if args.module == "services.rank.__main__":
        from services.common.device_peaks import measured_tflops
        from services.rank import data_client, memory_client, store_client  # noqa: F401

        measured_tflops("cpu", "float32")  # a CPU rank's MFU peak, measured once for every rank forked here
    sock = socket.socket(fileno=args.fd)
    # In the agent's fork server log: when it is ready, and what its imports cost.
    ready = {
        "event": "forkserver_ready",
        "pid": os.getpid(),
        "import_seconds": round(time.perf_counter() - _STARTED, 3),
    }
    print(json.dumps(ready), flush=True)
    forked = serve(sock)
    if forked is not None:  # this process is a rank now: it exits as one (SystemExit, atexit)
        _run_rank(*forked, module)


if __name__ == "__main__":
    main()
