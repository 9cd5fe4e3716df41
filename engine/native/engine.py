"""Our engine: the contract's layer template (engine/native/model.py) run over every execution path.

``plan`` builds the engine (checking §2.1(4) and (5) on the built model), serves any reused prefixes from a
prefix cache filled by earlier requests (contract §2.9), and plans the calls with their §2.11 faults;
``execute`` runs the calls in lockstep, layer by layer, and yields each layer index once every call has
finished it; the generator's return value is the run's record (reuse outcomes, invariant violations, fault
observability, compile time). ``ledger`` measures the shapes of contract §2.8 on a side it planned (the
``ledger`` command).
"""
from __future__ import annotations

import time

import torch

from .attention import standard_head_map
from .kv_cache import PrefixKV
from ..calls import Call, Faults, Placement, SkippedKV, call_routing, declare_ops_absent, forced_list, plan_calls
from .compiled import warm_up
from ..config import DECODE_FAULTS, ROUTER_FAULTS, RunConfig
from ..prepared import set_deterministic
from ..shared.errors import ConfigError
from .ledger import ledger  # the shape ledger of contract §2.8 of a side this engine planned (`prefill-diff ledger`)
from ..models.adapter import seeded_adapter
from ..models.hf_names import MOE_STYLE, ours_to_hf
from ..models.param_digests import module_digests, not_reported, stale_param, stale_param_layer
from ..decode import response_rows
from .prefill import Engine
from .settings import cache_config, numerical_config
from .reuse import PrefixCache
from ..models.snapshot import Snapshot


def check(prep) -> None:
    """Our engine runs every execution path; a tensor-parallel run must also split the MLP's rows evenly. A fault
    that cannot show on this model and these inputs is recorded as such (the report says INCONCLUSIVE)."""
    run, args = prep.side.run, prep.snapshot.args
    if run.tp > 1 and args.hidden_dim % run.tp:
        raise ConfigError(f"tp={run.tp} must divide the MLP width (got hidden_dim={args.hidden_dim})")
    if run.tp > 1 and run.options.compile:
        raise ConfigError("compile = true and tp > 1 together are not supported (compile one rank's layers, or "
                          "shard an eager model)")
    if run.options.compile:  # inductor's deterministic flag too (set_deterministic's docstring)
        set_deterministic(run.deterministic, compiling=True)
    if run.fault is not None:
        if run.fault.name == "stale-param":
            stale_param_layer(run.fault, args.n_layers)
        prep.record["fault"]["cannot_show"] = fault_note(run, prep.snapshot, prep.tokens)


def fault_note(run: RunConfig, snapshot: Snapshot, tokens) -> str | None:
    """Why this fault cannot show on this model and these inputs (None if it can)."""
    if run.fault is None:
        return None
    name, args = run.fault.name, snapshot.args
    lengths = [len(t) for t in tokens]
    if name == "gqa-mapping" and args.n_kv_heads < 2:
        return (f"fault:gqa-mapping cannot show on this model: it has n_kv_heads={args.n_kv_heads}, "
                "so every query head reads the same KV head whatever the mapping")
    padded = len(set(lengths)) > 1 and run.batching in ("left", "right")
    if name in ("unmasked-padding", "masked-row-softmax") and not (padded and run.batching == "left"):
        return (f"fault:{name} cannot show here: it needs a left-padded batch of unequal lengths "
                f"(batching={run.batching}, lengths={lengths})")
    if name == "last-column" and not (padded and run.batching == "right"):
        return (f"fault:last-column cannot show here: it needs a right-padded batch of unequal lengths "
                f"(batching={run.batching}, lengths={lengths})")
    if name == "window-off-by-one":
        windows = {args.window(layer) for layer in range(args.n_layers)} - {None}
        if not windows:
            return "fault:window-off-by-one cannot show on this model: it has no sliding-window layer"
        if max(lengths) <= min(windows):
            return (f"fault:window-off-by-one cannot show here: no prompt is longer than the window "
                    f"(window {min(windows)}, lengths {lengths})")
    if name in ROUTER_FAULTS and not args.n_experts:
        return f"fault:{name} cannot show on this model: it has no mixture of experts"
    if name == "shared-gate-dropped" and not args.shared_expert_dim:
        return f"fault:{name} cannot show on this model: its experts have no shared expert"
    if name in ("position-restart", "adapter-mismatch") and (
            run.reuse is None or all(len(t) <= run.reuse.prefix_len for t in tokens)):
        return f"fault:{name} cannot show here: no prompt is longer than the reused prefix"
    if name in DECODE_FAULTS and not run.decode:
        return f"fault:{name} cannot show here: the run writes no response token by token (decode = false)"
    if name == "decode-mask" and not (padded and run.batching == "left"):
        return (f"fault:decode-mask cannot show here: it needs a left-padded batch of unequal lengths "
                f"(batching={run.batching}, lengths={lengths})")
    return None


def plan(prep, positions, pad: int, tp) -> None:
    """Build the engine, serve any reused prefixes, plan the calls and their faults."""
    run, snapshot, tokens = prep.side.run, prep.snapshot, prep.tokens
    engine = Engine(snapshot, numerical_config(run), tp=tp)  # checks §2.1(4) and (5) on the built model
    prep.engine = engine
    prep.record["quantized_weights_digest"] = engine.quantized_digest
    if run.fault is not None and run.fault.name == "stale-param":
        layer = stale_param_layer(run.fault, snapshot.args.n_layers)
        stale_param(engine.model, f"layers.{layer}.attention.wk.weight")
    rows, pos, history = [list(t) for t in tokens], positions, {}
    if run.reuse is not None:
        history, outcomes = _build_prefixes(engine, snapshot, run, tokens, positions, prep.side.inputs.segments,
                                            prep.routing)
        prep.record["reuse"] = outcomes
        restart = run.fault is not None and run.fault.name == "position-restart"
        for s, kv in history.items():
            k = kv.length
            rows[s] = rows[s][k:]
            pos[s] = list(range(len(rows[s]))) if restart else pos[s][k:]
    prep.calls = plan_calls(rows, pos, list(range(len(tokens))), run.batching, pad, history)
    for call in prep.calls:
        call.faults = faults_for(run, snapshot, call, tokens)


def parameter_digests(prep) -> dict:
    """``meta.parameters`` of the model this side runs, under Hugging Face's names where hf_names.py maps ours
    (our own elsewhere: a LoRA-wrapped projection, an expert)."""
    if prep.side.run.tp > 1:
        return not_reported("a tensor-parallel rank holds a shard of each weight")
    args = prep.snapshot.args

    def rename(name: str) -> str:
        try:
            return ours_to_hf(name, args.norm_placement, MOE_STYLE.get(args.arch))
        except KeyError:
            return name
    return module_digests(prep.engine.model, "hf", rename)


def faults_for(run: RunConfig, snapshot: Snapshot, call: Call, tokens) -> Faults:
    """The execution faults of one call for the run's [fault] (contract §2.11)."""
    f = run.fault
    if f is None:
        return Faults()
    args = snapshot.args
    if f.name == "gqa-mapping":
        hm = standard_head_map(args.n_heads, args.n_kv_heads)
        hm[0] = (hm[0] + 1) % args.n_kv_heads
        return Faults(head_map=tuple(hm))
    if f.name == "skip-kv":
        layer = args.n_layers // 2 if f.layer is None else f.layer
        if not 0 <= layer < args.n_layers:
            raise ConfigError(f"fault skip-kv layer must be in [0, {args.n_layers}) (got {layer})")
        if not 0 <= f.sample < len(tokens):
            raise ConfigError(f"fault skip-kv sample must be in [0, {len(tokens)}) (got {f.sample})")
        if f.sample not in call.samples:
            return Faults()
        tok = f.token % len(tokens[f.sample])
        return Faults(skip_kv=SkippedKV(layer=layer, seq=call.samples.index(f.sample), token=tok))
    if f.name == "window-off-by-one":
        return Faults(window_shift=1)
    if f.name in ROUTER_FAULTS:
        return Faults(router=f.name)
    if f.name in DECODE_FAULTS:
        return Faults(decode_position=f.name == "decode-position", decode_stale_cache=f.name == "decode-stale-cache",
                      decode_mask=f.name == "decode-mask")
    return Faults(unmasked_padding=f.name == "unmasked-padding", masked_row_softmax=f.name == "masked-row-softmax",
                  last_column=f.name == "last-column")


def _reuse_meta(engine: Engine, run: RunConfig, tenant: str) -> dict:
    layout = cache_config(run).layout.resolved(engine.numerical.dtype)
    ident = engine.identity(layout)
    return {**ident, "position_numbering": "absolute, from 0", "mask_semantics": engine.args.attention_rule,
            "tenant": tenant}


def _build_prefixes(engine: Engine, snapshot: Snapshot, run: RunConfig, tokens, positions, segments,
                    routing: dict):
    """The earlier requests: prefill each prompt's first prefix_len tokens into a prefix cache, then look up.
    ``routing``: experts to force (routing replay), at the prefix's tokens as at the rest."""
    reuse = run.reuse
    k = reuse.prefix_len
    builder = engine
    if reuse.cache_adapter == "other":
        base = snapshot.adapter
        seed = 7 + (int(base.digest[7:15], 16) % 1000 if base else 0)  # stable: differs from the model's own
        other = seeded_adapter(snapshot.args, "other-adapter", rank=base.rank if base else 4, seed=seed)
        builder = Engine(snapshot.with_adapter(other), engine.numerical)
    pcache = PrefixCache(allow_cross_tenant=reuse.allow_cross_tenant)
    cache_tenant = reuse.cache_tenant or reuse.tenant
    for s, toks in enumerate(tokens):
        if len(toks) <= k:
            continue
        res = builder.prefill(torch.tensor([toks[:k]]), torch.ones(1, k, dtype=torch.long),
                              torch.tensor([positions[s][:k]]), cache_config(run), routing=call_routing(routing, [s]))
        kv = PrefixKV([res.kv_cache.stored(layer, 0) for layer in range(snapshot.args.n_layers)],
                      builder.identity(cache_config(run).layout.resolved(builder.numerical.dtype)))
        pcache.insert(toks[:k], kv, _reuse_meta(builder, run, cache_tenant), cache_tenant,
                      share=reuse.allow_cross_tenant)
    meta = _reuse_meta(engine, run, reuse.tenant)
    outcomes, history = [], {}
    for s, toks in enumerate(tokens):
        seg = segments[s] if segments else ()
        found = pcache.lookup(toks, k, meta, reuse.tenant, seg, force=reuse.force)
        outcomes.append({"sample": s, "prefix_len": k, "hit": found.hit, "forced": found.forced,
                         "reason": found.reason})
        if found.hit:
            history[s] = found.kv
    return history, outcomes


def generate(prep, n: int) -> tuple:
    """Each sample's next ``n`` tokens, greedily (argmax of the logits), one prefill of the sequence so far per
    token: the response our engine would write."""
    out = []
    for toks in prep.tokens:
        ids = list(toks)
        for _ in range(n):
            row = torch.tensor([ids])
            res = prep.engine.prefill(row, torch.ones_like(row), torch.arange(len(ids))[None], cache_config(prep.side.run))
            ids.append(int(torch.argmax(res.next_logits[0])))
        out.append(tuple(ids[len(toks):]))
    return tuple(out)


# how our engine rounds where an op's bits can part from another engine's (engine/native/model.py)
OPS_HOW = {"q_rope": "computes cos/sin in float32 and rounds them to the activation dtype before rotating",
           "k_rope": "computes cos/sin in float32 and rounds them to the activation dtype before rotating",
           "attn_residual": "adds the attention output to the residual in the activation dtype, then normalises the "
                            "rounded sum"}


def execute(prep, recorder):
    """Run the planned calls in lockstep; yield each completed layer; return the run record."""
    run, L = prep.side.run, prep.snapshot.args.n_layers
    recorder.update_meta(parameters=parameter_digests(prep))  # before the first layer: a lockstep run reads it
    declare_ops_absent(recorder, prep.snapshot.args, how=OPS_HOW)
    if run.options.compile:  # compile every shape the calls will see, timed apart from the recorded run
        prep.record["timing"] = {"compile_s": warm_up(prep)}
    if prep.routing:  # routing replay: the trace says where its router was overruled
        prep.record["routing_forced"] = forced_list(prep.routing)
    t0 = time.perf_counter()
    gens = [prep.engine.steps(c.ids, c.mask, c.positions, cache_config(run), segments=c.segments, history=c.history,
                              recorder=Placement(recorder, c.runs, c.samples), faults=c.faults,
                              routing=call_routing(prep.routing, c.samples), **response_rows(prep, c))
            for c in prep.calls]
    done = [-1] * len(gens)
    results = [None] * len(gens)
    for layer in range(L):
        for i, g in enumerate(gens):
            while done[i] < layer:
                done[i] = next(g)
        yield layer
    for i, g in enumerate(gens):
        try:
            next(g)
            raise RuntimeError("prefill yielded more layers than the model has")
        except StopIteration as stop:
            results[i] = stop.value
    if run.options.compile:
        prep.record["timing"]["prefill_s"] = time.perf_counter() - t0
    for call, res in zip(prep.calls, results):
        for v in res.cache_metadata["invariant_violations"]:
            prep.record["invariant_violations"].append(f"samples {call.samples}: {v}")
    return prep.record
