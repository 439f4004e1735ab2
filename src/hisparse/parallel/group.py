"""The ranks of one tensor-parallel engine: start-up, collectives, commands, liveness.

One engine runs SPMD (docs/design.md §18): every rank holds the same scheduler, KV manager and
runner over its shard of the model. Rank 0 is the driver (the user's `LLM`); it sends every
accepted request, abort and step to the other ranks (`send` / `recv`, over a gloo group of its
own), samples, and broadcasts the sampled tokens (`share_tokens`). Ranks start either as
processes the driver spawns (`torch.multiprocessing`, a TCP store on a free port) or under
``torchrun`` (``env://``: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT), where the
processes other than rank 0 serve rank 0's engines (`serve_torchrun_ranks`: the process group is
made once per process, each `LLM` rank 0 builds is announced with its arguments) until rank 0's
process ends.

Failures end the engine in bounded time: collectives have a timeout (``HISPARSE_TP_TIMEOUT``
seconds, 600 by default; gloo also fails at once when a peer's socket closes), the driver
checks its workers' processes before every command, a spawned worker exits when its parent
does, and whatever fails reaches the driver as `TensorParallelError` naming the rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hisparse import envs

#: Seconds a collective of a step (or of start-up) may wait for the other ranks.
TIMEOUT_ENV = "HISPARSE_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
#: How long a worker waits for the driver's next command (an idle server sends none).
IDLE_TIMEOUT = datetime.timedelta(days=365)
#: Seconds the driver waits for its workers to exit after ``close``.
JOIN_TIMEOUT_S = 30.0


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed (died, timed out, raised); the engine is
    closed. The message names the rank and what is known of why."""


def timeout_s() -> float:
    """``$HISPARSE_TP_TIMEOUT`` (`hisparse.envs`), or `DEFAULT_TIMEOUT_S`."""
    return envs.value(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S


def torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE of a ``torchrun`` launch (None: not one)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    return dict(
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )


@dataclass
class WorkerSpec:
    """What a spawned worker needs to join its driver's engine."""

    rank: int
    world_size: int
    store_port: int
    timeout_s: float
    num_threads: int
    parent_pid: int
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


#: Set in a spawned worker while its `LLM` is being built (the constructor joins as that rank).
_WORKER: WorkerSpec | None = None
#: torchrun: this process's (step group, command group), made once for all its engines.
_TORCHRUN_GROUPS: tuple[Any, Any] | None = None
#: torchrun, a rank other than 0: the `LLM` being built is rank 0's engine, announced.
_TORCHRUN_WORKER = False


class TPGroup:
    """This process's rank in one tensor-parallel engine (driver or worker)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        device: torch.device,
        launch: str,
        timeout: float,
        kind: str = "tensor-parallel",
    ) -> None:
        self.rank, self.world_size = rank, world_size
        #: how errors name the ranks: ``tensor-parallel`` or ``data-parallel``
        self.kind = kind
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.device = device
        #: "spawn" (the driver started the workers) or "torchrun"
        self.launch = launch
        self.timeout = timeout
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.group: Any = None  # collectives of a step (the default group)
        self.control: Any = None  # commands (gloo, waits as long as the driver idles)
        self.workers: list[Any] = []  # the driver's spawned processes (rank 1, 2, ...)
        self.reports: list[Any] = []  # their pipes: ("up",) then ("error", traceback)
        self.pool_name = ""
        self._owns_default_group = False
        self.closed = False
        self.failed = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # --- start-up ------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        world_size: int,
        device: torch.device,
        llm_kwargs: dict[str, Any],
        *,
        worker_main: Callable[[WorkerSpec, Any], None],
        serve_ranks: Callable[[torch.device], None],
        kind: str = "tensor-parallel",
    ) -> TPGroup:
        """This process's rank: a spawned worker (`_WORKER`), a ``torchrun`` rank, or a
        driver that spawns ranks 1 .. ``world_size - 1`` now. The engine's entry points are
        passed in (this package never imports the engine): ``worker_main(spec, report)``
        runs a spawned rank, ``serve_ranks(device)`` a torchrun rank other than 0 (never
        returns)."""
        timeout = timeout_s()
        if _WORKER is not None:
            spec = _WORKER
            tp = cls(rank=spec.rank, world_size=spec.world_size, local_rank=spec.rank,
                     local_world_size=spec.world_size, device=rank_device(device, spec.rank),
                     launch="spawn", timeout=spec.timeout_s, kind=kind)  # fmt: skip
            store = dist.TCPStore("127.0.0.1", spec.store_port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=spec.timeout_s))  # fmt: skip
            tp._init_groups(store)
            return tp
        env = torchrun_env()
        if env is not None and env["world_size"] > 1:
            if env["world_size"] != world_size:
                raise ValueError(
                    f"torchrun started WORLD_SIZE={env['world_size']} processes but "
                    f"tensor_parallel_size={world_size}; start one process per rank "
                    f"(torchrun --nproc-per-node {world_size} ...)."
                )
            if env["rank"] > 0 and not _TORCHRUN_WORKER:
                serve_ranks(device)  # never returns: this process serves rank 0
            tp = cls(**env, device=rank_device(device, env["local_rank"]), launch="torchrun",
                     timeout=timeout, kind=kind)  # fmt: skip
            tp.group, tp.control = torchrun_groups(tp.device)
            if tp.is_driver:  # the other ranks build the same engine
                dist.broadcast_object_list([("engine", llm_kwargs)], src=0, group=tp.control)
            tp._name_pool()
            return tp
        _check_devices(device, world_size)
        tp = cls(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size,
                 device=rank_device(device, 0), launch="spawn", timeout=timeout,
                 kind=kind)  # fmt: skip
        try:
            store = tp._spawn(llm_kwargs, worker_main)
            tp._init_groups(store)
        except BaseException as err:
            raise tp.fail(err) from err
        return tp

    def _spawn(self, llm_kwargs: dict[str, Any], worker_main: Callable[..., None]) -> Any:
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process; a "
                "tensor-parallel LLM spawns its own ranks (or start it under torchrun)."
            )
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=self.timeout),
                              wait_for_workers=False)  # fmt: skip
        ctx = mp.get_context("spawn")
        threads = max(1, torch.get_num_threads() // self.world_size)
        for rank in range(1, self.world_size):
            spec = WorkerSpec(rank, self.world_size, store.port, self.timeout, threads,
                              os.getpid(), llm_kwargs)  # fmt: skip
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(spec, writer), daemon=True,
                               name=f"hisparse-tp-rank{rank}")  # fmt: skip
            proc.start()
            writer.close()
            self.workers.append(proc)
            self.reports.append(reader)
        self._wait_up()
        return store

    def _wait_up(self) -> None:
        """Every worker imported hisparse and is about to join (or the first that died)."""
        from multiprocessing.connection import wait

        waiting = dict(enumerate(self.reports, start=1))
        deadline = time.monotonic() + self.timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(
                    f"{self.kind} ranks {sorted(waiting)} did not start within "
                    f"{self.timeout:.0f} s ({TIMEOUT_ENV})"
                )
            sentinels = {self.workers[r - 1].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=min(left, 1.0))
            for obj in ready:
                rank = sentinels.get(obj)  # type: ignore[call-overload]
                if rank is not None:
                    self.check_workers()
                    continue
                rank = next(r for r, conn in waiting.items() if conn is obj)
                msg = _recv(obj)
                if msg is None or msg[0] != "up":
                    self.check_workers()
                    raise TensorParallelError(_describe(rank, None, msg, self.kind))
                del waiting[rank]

    def _init_groups(self, store: Any) -> None:
        """Spawned ranks: the process group of this engine (made here, dropped with it)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kw: dict[str, Any] = dict(backend=self.backend, rank=self.rank,
                                  world_size=self.world_size, store=store,
                                  timeout=datetime.timedelta(seconds=self.timeout))  # fmt: skip
        if self.device.type == "cuda":
            kw["device_id"] = self.device
        dist.init_process_group(**kw)
        self._owns_default_group = True
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._name_pool()

    def _name_pool(self) -> None:
        name = f"hisparse-{os.getpid()}-{uuid.uuid4().hex[:12]}" if self.is_driver else None
        self.pool_name = str(self.from_driver(name))

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # --- collectives of a step -------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t``, the same bits on every rank.

        gloo: the parts are gathered and added in rank order (gloo's own reduction order
        depends on its algorithm); NCCL: its all-reduce (ring and tree reductions compute
        each element's sum once and distribute it)."""
        if self.backend == "nccl":
            out = t.contiguous()
            dist.all_reduce(out, group=self.group)
            return out
        src = t.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        dist.all_gather(parts, src, group=self.group)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def share_tokens(self, tokens: list[int | None] | None, n: int) -> list[int | None]:
        """Rank 0's sampled tokens (``None``: a row that failed) on every rank."""
        if self.is_driver:
            assert tokens is not None and len(tokens) == n
            values = [-1 if t is None else int(t) for t in tokens]
            buf = torch.tensor(values, dtype=torch.int64, device=self._comm_device)
        else:
            buf = torch.empty(n, dtype=torch.int64, device=self._comm_device)
        dist.broadcast(buf, src=0, group=self.group)
        if self.is_driver:
            return list(tokens)  # type: ignore[arg-type]
        return [None if t < 0 else t for t in buf.tolist()]

    def fence(self) -> None:
        """An empty all-reduce: on CUDA it orders every rank's later work after the work
        every rank queued before it, without a host sync (docs/design.md §18)."""
        dist.all_reduce(torch.zeros(1, device=self._comm_device), group=self.group)

    def agree_min(self, value: float) -> float:
        """The smallest of every rank's ``value`` (e.g. the KV budget each GPU can give)."""
        buf = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.group)
        return float(buf.item())

    def from_driver(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a value each rank could compute differently)."""
        box = [value if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.group, device=self._comm_device)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    # --- commands (driver -> workers) ------------------------------------------------------
    def send(self, command: tuple[Any, ...]) -> None:
        """Driver: one command to every worker, in order."""
        self.check_workers()
        dist.broadcast_object_list([command], src=0, group=self.control)

    def recv(self) -> tuple[Any, ...]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the driver (in rank order); ``None`` elsewhere."""
        out = [None] * self.world_size if self.is_driver else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    # --- liveness and shutdown -------------------------------------------------------------
    def check_workers(self) -> None:
        """Driver: a `TensorParallelError` naming the first spawned worker that is gone."""
        for rank, proc in enumerate(self.workers, start=1):
            if not proc.is_alive():
                report = _last_report(self.reports[rank - 1])
                raise TensorParallelError(_describe(rank, proc.exitcode, report, self.kind))

    def fail(self, err: BaseException) -> TensorParallelError:
        """Driver or worker: end this engine after ``err`` (kill the spawned workers, drop the
        process groups) and return the error to raise, naming what is known."""
        if isinstance(err, TensorParallelError):
            out = err
        else:
            why = []
            for rank, proc in enumerate(self.workers, start=1):
                proc.join(timeout=0.5)
                if not proc.is_alive():
                    report = _last_report(self.reports[rank - 1])
                    why.append(_describe(rank, proc.exitcode, report, self.kind))
            detail = "; ".join(why) if why else f"{type(err).__name__}: {err}"
            out = TensorParallelError(
                f"{self.kind} rank {self.rank}: the engine failed ({detail}); it is closed"
            )
        self.failed = True
        self.shutdown(graceful=False)
        return out

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (``close`` first when ``graceful``) and drop the process groups;
        idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.launch == "torchrun":
            # the processes stay (they serve rank 0's next engine); a failed group goes
            if self.is_driver and graceful:
                self.send(("close",))
            from hisparse.parallel.shm import unlink_pool_file

            unlink_pool_file(self)
            if not graceful:
                drop_torchrun_groups()
            self.group = self.control = None  # the process's groups: `drop_torchrun_groups`
            return
        if self.is_driver and graceful and self.workers:
            with contextlib.suppress(Exception):
                self.send(("close",))
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for proc in self.workers:
                proc.join(timeout=max(deadline - time.monotonic(), 0.1))
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
        for proc in self.workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.reports:
            conn.close()
        from hisparse.parallel.shm import unlink_pool_file

        unlink_pool_file(self)
        if self._owns_default_group and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.group = self.control = None


def torchrun_groups(device: torch.device) -> tuple[Any, Any]:
    """This torchrun process's (step group, command group): the default process group
    (``env://``; NCCL on CUDA, gloo on the CPU) and a gloo group for commands, made on first
    use. Rank 0 tells the others to exit when its process ends."""
    global _TORCHRUN_GROUPS
    if _TORCHRUN_GROUPS is None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            kw: dict[str, Any] = dict(backend="nccl" if device.type == "cuda" else "gloo",
                                      init_method="env://",
                                      timeout=datetime.timedelta(seconds=timeout_s()))  # fmt: skip
            if device.type == "cuda":
                kw["device_id"] = device
            dist.init_process_group(**kw)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        _TORCHRUN_GROUPS = (dist.group.WORLD, control)
        if dist.get_rank() == 0:
            atexit.register(_release_torchrun_ranks)
    return _TORCHRUN_GROUPS


def _release_torchrun_ranks() -> None:
    """Rank 0's process ends: the other ranks exit too."""
    if _TORCHRUN_GROUPS is not None:
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([("exit",)], src=0, group=_TORCHRUN_GROUPS[1])
    drop_torchrun_groups()


def drop_torchrun_groups() -> None:
    """Destroy this process's groups now, while the interpreter still runs: a group whose C++
    object outlives `destroy_process_group` (a closed engine still referring to it) keeps its
    gloo threads, and one that frees its last collective's tensors during finalization aborts
    the process ("terminate called without an active exception"). Every engine drops its
    references in `TPGroup.shutdown`; the collection frees those held in cycles."""
    global _TORCHRUN_GROUPS
    _TORCHRUN_GROUPS = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    gc.collect()


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else torch.device("cpu")


def _check_devices(device: torch.device, world_size: int) -> None:
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        from hisparse.validation import _fail

        _fail(
            "LLM.tensor_parallel_size", world_size,
            f"at most the {torch.cuda.device_count()} CUDA devices of this host (one per rank; "
            "more nodes start under torchrun)",
        )  # fmt: skip


def _recv(conn: Any) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _last_report(conn: Any) -> Any:
    """The last message a worker left on its pipe (its traceback, if it raised)."""
    msg = None
    try:
        while conn.poll():
            msg = conn.recv()
    except (EOFError, OSError):
        pass
    return msg


def _describe(rank: int, exitcode: int | None, report: Any, kind: str = "tensor-parallel") -> str:
    if exitcode is None:
        what = "stopped reporting"
    elif exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        what = f"was killed by {name}"
    else:
        what = f"exited with status {exitcode}"
    text = f"{kind} rank {rank} {what}"
    if report is not None and report[0] == "error":
        text += f"; its error:\n{report[1].rstrip()}"
    return text


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Ctrl-C inside the block is raised when it ends: every rank must finish a step together
    (a driver leaving a collective halfway would strand the others). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def joining_as_worker(spec: WorkerSpec | None = None) -> Iterator[None]:
    """While an engine is built in a worker process: `TPGroup.start` joins as the spawned
    rank ``spec``, or (``None``) as the torchrun rank of this process serving rank 0."""
    global _WORKER, _TORCHRUN_WORKER
    if spec is not None:
        _WORKER = spec
    else:
        _TORCHRUN_WORKER = True
    try:
        yield
    finally:
        _WORKER, _TORCHRUN_WORKER = None, False


def exit_with_parent(parent: int) -> None:
    """A spawned worker never outlives its driver (killed, or gone without ``close``)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)
