"""transformers' model under torch FSDP2, run data parallel as a trainer runs its forward.

The model is the transformers engine's (hf_engine.build_model), wrapped by ``torch.distributed.fsdp.fully_shard``
on each decoder layer and then on the root, with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` from
``[run.fsdp2]``. The tool spawns ``ranks`` processes (engine/parallel.py ``launch``, gloo on 127.0.0.1); each holds
a shard of every parameter, and every forward all-gathers each layer's parameters from all ranks, cast to
param_dtype.

The prompts are dealt out strided, as a trainer's sampler without shuffling does: rank r of N runs samples r, r + N,
r + 2N, ..., planned in the run's batching (one call per sample unbatched, one padded batch of its samples
otherwise). Each rank runs its calls through hf_engine's ``forward_call`` and hooks into a ``RankTape``
(rank_tape.py), which keeps the recorder writes in the trace's sample coordinates; every forward is a collective,
so a rank with fewer forwards than the busiest runs idle forwards of one padding token (not recorded). The launcher
replays the tapes in the order of the run's plan into the one trace: laid out as one process's trace of the same
calls, with ``meta.parallel`` (kind "data", strategy "fsdp2", the world and the policy) and ``meta.record.fsdp2``
(the policy, the parameters' and buffers' dtypes as the model ran, each rank's share).

``load`` "cast" loads float32 and casts with ``model.to(param dtype)``, which casts RoPE's ``inv_freq`` buffer
too (FSDP2's policy casts parameters only): the loader trap, shown in the record's ``buffers`` and in
``meta.parameters`` (``digests``: every parameter as FSDP2 holds it, gathered from the shards, and every buffer).

With ``--level ops`` each rank's capture (hf_ops.py) writes the ops into its tape, whose ``ops`` answers the
trace's request (rank_tape.RankOps); they reach the trace in plan order with the states. ``replay_ops`` replays
on transformers' model loaded as the ranks load it, in this process: outside the process group.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from .. import parallel
from ..calls import Placement, call_routing, plan_calls
from ..decode import response_rows
from ..models.dtypes import torch_dtype
from ..models.param_digests import tensor_digests
from ..shared.errors import ConfigError, PrefillDiffError
from . import hf_engine, hf_replay, rank_tape


def _fsdp():
    """torch's FSDP2 (fully_shard, MixedPrecisionPolicy), or None where this torch has none."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        return None
    return fully_shard, MixedPrecisionPolicy


def check(prep) -> None:
    """What transformers runs (hf_engine.check), on a torch with FSDP2 and gloo, in the run's own dtype."""
    run = prep.side.run
    hf_engine.check(prep)
    opts = run.options
    if opts.param_dtype is not None and opts.param_dtype != run.dtype:
        raise ConfigError(f"[run.fsdp2] param_dtype must be the run's dtype, the dtype its forward computes and the "
                          f"trace records in (got param_dtype={opts.param_dtype!r}, dtype={run.dtype!r}): set "
                          f"[run] dtype instead")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available() or _fsdp() is None:
        raise ConfigError(f"the fsdp2 engine needs torch.distributed with gloo and FSDP2 (fully_shard: torch 2.6 or "
                          f"later; found torch {torch.__version__})")


def plan(prep, positions, pad: int, tp) -> None:
    """Each rank's calls (samples r, r + N, ...; in the run's batching), all in one plan ordered by first sample;
    ``prep.extras["rank_calls"]``: each rank's call indices."""
    world, batching = prep.side.run.options.ranks, prep.side.run.batching
    by_rank = []
    for r in range(world):
        mine = list(range(r, len(prep.tokens), world))
        by_rank.append(plan_calls([list(prep.tokens[s]) for s in mine], [positions[s] for s in mine], mine, batching,
                                  pad) if mine else [])
    calls = sorted((c for cs in by_rank for c in cs), key=lambda c: min(c.samples))
    prep.calls = calls
    prep.extras["rank_calls"] = [[next(i for i, c in enumerate(calls) if c is mine) for mine in cs] for cs in by_rank]


def policy(run) -> dict:
    """The mixed-precision policy and fully_shard's settings, as the record says them."""
    opts = run.options
    return {"param_dtype": opts.param_dtype or run.dtype, "reduce_dtype": opts.reduce_dtype,
            "reshard_after_forward": opts.reshard_after_forward}


def shard(model, mesh, run) -> None:
    """fully_shard on each decoder layer, then on the root, with the run's MixedPrecisionPolicy."""
    fully_shard, MixedPrecisionPolicy = _fsdp()
    p = policy(run)
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(p["param_dtype"]), reduce_dtype=torch_dtype(p["reduce_dtype"]))
    layers, _ = hf_engine.decoder(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=p["reshard_after_forward"])
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=p["reshard_after_forward"])


def digests(model, rank: int) -> dict | None:
    """``meta.parameters`` of the model as FSDP2 holds it after ``fully_shard``, before any forward: "after sync",
    as the trainer holds it. Each parameter is a DTensor sharded over the ranks, so it is gathered whole
    (``full_tensor``: a collective every rank joins, in named_parameters' order) rather than digested before
    sharding: what the shards hold is what is digested. Buffers (RoPE's inv_freq) are not sharded: digested as they
    are, in their own dtype. Rank 0's list; None on the others."""
    def gathered():
        for name, p in model.named_parameters():
            yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p)
    if rank != 0:
        for _ in gathered():
            pass
        return None
    return tensor_digests(gathered(), model.named_buffers(), "hf")


def _planned_forwards(prep) -> list[int]:
    """Each rank's model forwards for its calls."""
    return [sum(hf_engine.forwards(prep.calls[i], response_rows(prep, prep.calls[i]).get("decode_from"))
                for i in calls) for calls in prep.extras["rank_calls"]]


def _run_rank(ctx, side, routing, out: str, ops) -> None:
    """This rank's share: plan as the launcher did, load, shard, run its calls into a tape, saved to out/rank{r}.pt.
    ``ops``: None (no op-level states), or ``(layers,)``: the trace records the ops of ``layers`` (None: every one)."""
    from ..prepared import prepare  # prepared imports the registry, which names this module
    t0 = time.time()
    prep = prepare(side, routing=routing)
    run = prep.side.run
    model = hf_engine.build_model(prep.snapshot, run.dtype, run.options.attn_implementation, run.options.load,
                                  tensor_parallel=False)
    shard(model, ctx.mesh, run)
    parameters = digests(model, ctx.rank)
    t1 = time.time()
    tape, absent = rank_tape.RankTape(ops is not None, ops[0] if ops is not None else None), {}
    moe = prep.snapshot.foreign is None and prep.snapshot.args.n_experts > 0  # as hf_engine.execute
    mine = prep.extras["rank_calls"][ctx.rank]
    for i in mine:
        call = prep.calls[i]
        with tape.call(i):
            absent.update(hf_engine.forward_call(model, call, Placement(tape, call.runs, call.samples),
                                                 call_routing(prep.routing, call.samples), record_routing=moe,
                                                 **response_rows(prep, call)))
    planned = _planned_forwards(prep)
    idle = max(planned) - planned[ctx.rank]
    with torch.no_grad():  # every forward all-gathers from every rank: as many as the busiest rank's
        for _ in range(idle):
            model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=False)
    t2 = time.time()
    counts = {}
    for p in model.parameters():
        counts[str(p.dtype).removeprefix("torch.")] = counts.get(str(p.dtype).removeprefix("torch."), 0) + 1
    rank = {"rank": ctx.rank, "samples": sum(len(prep.calls[i].samples) for i in mine), "forwards": planned[ctx.rank],
            "idle_forwards": idle, "startup_s": ctx.startup_s, "prepare_s": t1 - t0, "forward_s": t2 - t1}
    tape.save(os.path.join(out, f"rank{ctx.rank}.pt"), absent=absent, rank=rank, parameters=counts,
              buffers=hf_engine.buffer_dtypes(model), digests=parameters)


def _rank_main(rank, world, port, started, side, routing, out, ops):
    """One rank's process: join the group, run its share; errors go to out/error-rank{rank}.txt."""
    parallel.run_rank(out, rank, lambda: _run_rank(parallel.init_group(rank, world, port, started=started,
                                                                       mesh_dim="dp"), side, routing, out, ops))


def _rank_error(out: str, world: int, exc: Exception) -> Exception:
    """The first rank's own error, in one line (bad input: PrefillDiffError), else what spawn said."""
    for r, kind, msg in parallel.rank_errors(out, world)[:1]:
        return PrefillDiffError(msg) if kind == "input" else RuntimeError(f"fsdp2 rank {r} failed: {msg}")
    return RuntimeError(f"fsdp2 ranks failed: {(str(exc).splitlines() or [''])[0][:300]}")


def execute(prep, recorder):
    """Spawn the ranks, replay their tapes into ``recorder`` in the plan's order, then yield each layer."""
    run = prep.side.run
    check(prep)
    world = run.options.ranks
    ops = getattr(recorder, "ops", None)  # the op request the ranks' tapes answer (rank_tape.RankOps)
    with tempfile.TemporaryDirectory(prefix="prefill-diff-fsdp2-") as out:
        try:
            parallel.launch(_rank_main, world, (prep.side, prep.routing, out, None if ops is None else (ops.layers,)))
        except Exception as e:
            raise _rank_error(out, world, e) from None
        tapes = [rank_tape.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    rank_tape.replay(tapes, recorder)
    recorder.update_meta(parameters=tapes[0]["digests"])  # rank 0's: every parameter gathered, every buffer
    absent = {k: v for t in tapes for k, v in t["absent"].items()}
    if absent:  # the trace says which states this model's layers do not have, and why
        recorder.update_meta(absent_states=absent)
    recorder.update_meta(parallel={"kind": "data", "strategy": "fsdp2", "mesh": [world], "mesh_dims": ["dp"],
                                   "world_size": world, "backend": "gloo", "policy": policy(run),
                                   "layout": "one trace: each rank's samples written in the plan's order"})
    prep.record["fsdp2"] = {"load": run.options.load, "buffers": tapes[0]["buffers"], "torch": torch.__version__,
                            "parameters": tapes[0]["parameters"], "policy": policy(run), "split": "strided",
                            "ranks": [t["rank"] for t in tapes]}
    for layer in range(prep.snapshot.args.n_layers):
        yield layer
    return prep.record


def replay_ops(prep, given):
    """transformers' op replay (hf_replay.py) on the model the ranks compute with, built in this process: FSDP2's
    module cannot run outside its process group, so transformers' model is loaded as ``_run_rank`` loads it (the
    run's dtype, ``load``, no tensor parallelism). The policy's param_dtype is the run's dtype (``check``), so the
    ranks' all-gather hands each layer these same parameters, bit for bit."""
    run = prep.side.run
    check(prep)
    model = hf_engine.build_model(prep.snapshot, run.dtype, run.options.attn_implementation, run.options.load,
                                  tensor_parallel=False)
    out = hf_replay.replay_model(model, given, run.dtype)
    out.notes.insert(0, "replayed on transformers' model loaded as fsdp2 loads it, outside the process group")
    return out
