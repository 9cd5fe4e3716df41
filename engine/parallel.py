"""Tensor parallelism on torch.distributed: N processes of one group, each a rank holding its share of the heads.

Rank r of N holds query heads [r·H_q/N, (r+1)·H_q/N) and KV heads [r·H_kv/N, (r+1)·H_kv/N) (and its share of the
MLP's rows): because g(h) = ⌊h·H_kv/H_q⌋ maps contiguous runs of query heads onto one KV head, every query head's
KV head lives on its own rank. How a model is sharded is its engine's own (ours: engine/native/sharding.py).

The tool starts the group itself (``launch``): torch.multiprocessing.spawn, gloo, a free port on
127.0.0.1, one torch thread per rank. Under ``torchrun`` (across machines) ``init_group`` reads the
usual environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) instead: see docs/scaling.md.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from .shared.errors import ConfigError, PrefillDiffError

TP_FAULTS = ("tp-missing-allreduce", "tp-kv-shard")


def check_tp(tp: int, args, *, adapter=None, weight_quant: str = "none", fault: str | None = None) -> None:
    """Refuse a tensor-parallel size the model cannot be sharded by, before any process starts (what each engine
    needs besides is its own ``check``)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer (got tp={tp!r})")
    if fault in TP_FAULTS and tp < 2:
        raise ConfigError(f"fault {fault} needs a tensor-parallel run (tp >= 2; got tp={tp})")
    if tp == 1:
        return
    bad = [f"{name}={getattr(args, name)}" for name in ("n_heads", "n_kv_heads") if getattr(args, name) % tp]
    if bad:
        fits = [n for n in range(2, args.n_kv_heads + 1) if args.n_heads % n == 0 and args.n_kv_heads % n == 0]
        hint = f"; sizes that fit: {', '.join(map(str, fits))}" if fits else "; no size above 1 fits this model"
        raise ConfigError(f"tp={tp} must divide both n_heads and n_kv_heads (whole heads per rank), "
                          f"but {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by {tp}{hint}")
    if getattr(args, "qk_norm", "none") == "proj":
        raise ConfigError(f"tp={tp}: this model's QK-norm normalises the whole Q and K projections ({args.arch}), "
                          "which needs every head's values, and each rank holds only its own heads")
    if getattr(args, "n_experts", 0):
        raise ConfigError(f"tp={tp}: a mixture of experts ({args.arch}) is not sharded: tensor parallelism here "
                          "splits attention heads and one dense MLP's width, not experts")
    if adapter is not None:
        raise ConfigError("tp > 1 shards plain linear layers: LoRA adapters are not supported with tensor parallelism")
    if weight_quant != "none":
        raise ConfigError(f"tp > 1 shards plain linear layers: weight_quant={weight_quant!r} is not supported "
                          "with tensor parallelism")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_ranges(args, rank: int, world: int) -> dict:
    """The global heads (and MLP rows) rank ``rank`` of ``world`` holds: [start, stop) each."""
    q, kv, hid = args.n_heads // world, args.n_kv_heads // world, args.hidden_dim // world
    return {"query_heads": [rank * q, (rank + 1) * q], "kv_heads": [rank * kv, (rank + 1) * kv],
            "mlp_rows": [rank * hid, (rank + 1) * hid]}


@dataclass
class TPContext:
    """This process's place in the tensor-parallel group (set by ``init_group``)."""
    rank: int
    world: int
    fault: str | None = None
    mesh: object = None
    started: float = 0.0  # time.time() when the launcher spawned the ranks
    startup_s: float | None = None  # spawn -> process group ready
    init_s: float | None = None  # init_process_group alone
    extra: dict = field(default_factory=dict)

    def local_args(self, args):
        """The model arguments as this rank's modules see them: its share of the heads and MLP rows."""
        return args.replace(n_heads=args.n_heads // self.world, n_kv_heads=args.n_kv_heads // self.world,
                            hidden_dim=args.hidden_dim // self.world)

    def describe(self, args) -> dict:
        """What the trace's ``parallel`` metadata declares about this rank."""
        return {"kind": "tensor", "mesh": [self.world], "mesh_dims": ["tp"], "rank": self.rank,
                "world_size": self.world, "backend": "gloo", **head_ranges(args, self.rank, self.world),
                "startup_s": self.startup_s, "init_process_group_s": self.init_s, **self.extra}


_CURRENT: list = []  # the TPContext of this process, if it is a rank


def current() -> TPContext | None:
    return _CURRENT[0] if _CURRENT else None


def init_group(rank: int, world: int, port: int | None, fault: str | None = None, started: float = 0.0,
               timeout_s: float = 120.0, mesh_dim: str = "tp") -> TPContext:
    """Join the process group (gloo) and build the 1-D device mesh (its dimension named ``mesh_dim``: "dp" for a
    data-parallel group). One torch thread per rank."""
    import torch.distributed as dist  # torch.distributed: imported only by tensor-parallel runs
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    env = port is None  # torchrun: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment
    if not env:  # spawned processes set none of these; transformers and DTensor read some of them
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    t0 = time.time()
    dist.init_process_group("gloo", init_method="env://" if env else f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    init_s = time.time() - t0
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(mesh_dim,))
    ctx = TPContext(rank, world, fault, mesh, started, (time.time() - started) if started else None, init_s)
    _CURRENT[:] = [ctx]
    return ctx


def close_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    _CURRENT.clear()


def launch(fn, world: int, args: tuple) -> None:
    """Run fn(rank, world, port, started, *args) in ``world`` spawned processes; raises if one fails."""
    import torch.multiprocessing as mp
    port = free_port()
    # the ranks' c10d warnings, and spawn's own "Terminating process" when one fails, are not ours to print: the
    # failure is said in one line by the caller (errors still reach stderr)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    quiet = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    saved = {k: os.environ.get(k) for k in quiet}
    os.environ.update({k: os.environ.get(k) or v for k, v in quiet.items()})  # a user's own setting wins
    try:
        mp.spawn(fn, args=(world, port, time.time()) + tuple(args), nprocs=world, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_rank(out: str, rank: int, body, *, exit_on_error: bool = True) -> None:
    """One rank's work, ``body()``, then the group closed. An error is written to ``out/error-rank{rank}.txt``
    (``rank_errors`` reads it: ``input`` for bad input, which a spawned rank then exits 2 on, else ``internal``).
    With ``exit_on_error`` (a spawned rank) a rank whose files are in place skips the interpreter's teardown
    (seconds of torch/h5py finalisers on a loaded machine; measured in bench_tp.py); without it (a rank torchrun
    started) bad input is raised."""
    try:
        body()
    except PrefillDiffError as e:
        _write_error(out, rank, "input", str(e))
        if not exit_on_error:
            raise
        sys.exit(2)
    except BaseException as e:
        _write_error(out, rank, "internal", f"{type(e).__name__}: {e}")
        raise
    finally:
        close_group()
    if exit_on_error:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _write_error(out: str, rank: int, kind: str, msg: str) -> None:
    try:
        with open(os.path.join(out, f"error-rank{rank}.txt"), "w", encoding="utf-8") as f:
            f.write(f"{kind}\t{msg}")
    except OSError:
        pass


def rank_errors(out: str, world: int) -> list:
    """(rank, kind, message) of each rank that wrote its error (``run_rank``), in rank order."""
    errors = []
    for r in range(world):
        p = os.path.join(out, f"error-rank{r}.txt")
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                kind, _, msg = f.read().partition("\t")
            errors.append((r, kind, msg))
    return errors
