"""Execution paths: turn (model, inputs, run config) into prefill calls and stream them to a recorder.

Every path — one sample at a time, a left- or right-padded batch, a packed row,
prefix reuse, chunked — is a list of ``Call``s. Each call carries a ``Placement``
that maps its rows, columns and sequences onto the trace's coordinates: one trace
row per sample, columns as the engine laid them out (padding kept visible).

``execute`` runs the calls in lockstep, layer by layer, and yields each layer index
once every call has finished it; the generator's return value is the run's record
(reuse outcomes, invariant violations, fault observability).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from . import budget, contract, llamacpp_engine, parallel
from .adapters import seeded_adapter
from .attention import standard_head_map
from .cache import PrefixKV
from .calls import Call, Placement, plan_calls
from .compiled import warm_up
from .config import Inputs, RunConfig, Side
from .errors import ConfigError, PreconditionError
from .faults import Faults, SkippedKV
from .prefill import Engine
from .reuse import PrefixCache
from .snapshot import Snapshot
from .sources import load_snapshot

DEFAULT_TEXT_PROMPTS = ("The capital of France is", "Hello, my name is", "In 1969, the first man on the moon was")
DEFAULT_LENGTHS = (12, 5, 9)


def default_token_ids(vocab_size: int, lengths=DEFAULT_LENGTHS) -> tuple:
    """Built-in prompts of unequal lengths for models without a tokenizer; seeded, never id 0 (the pad id)."""
    g = torch.Generator().manual_seed(2024)
    return tuple(tuple(torch.randint(1, vocab_size, (n,), generator=g).tolist()) for n in lengths)


def apply_mask(inputs: Inputs) -> Inputs:
    """Rows given with their padding ([inputs] attention_mask): check the mask (§2.1(2)), keep the valid tokens."""
    if inputs.attention_mask is None:
        return inputs
    ids, masks = inputs.token_ids, inputs.attention_mask
    if not ids or len(masks) != len(ids):
        raise PreconditionError("2.1(2)", f"attention_mask must have one row per token_ids row "
                                f"(got {len(masks)} rows for {len(ids)} samples)")
    for b, (row, m) in enumerate(zip(ids, masks)):
        if len(m) != len(row):
            raise PreconditionError("2.1(2)", f"the validity mask must have the shape of input_ids (sample {b}: "
                                    f"{len(m)} mask values for {len(row)} ids)")
    for b, m in enumerate(masks):
        for i, v in enumerate(m):
            if isinstance(v, bool) or v not in (0, 1):
                raise PreconditionError("2.1(2)", f"the validity mask must hold only 0 and 1 "
                                        f"(sample {b}, position {i}: {v!r})")
    n = max(len(r) for r in ids)
    rect = torch.zeros((len(ids), n), dtype=torch.long)
    mrect = torch.zeros((len(ids), n), dtype=torch.long)
    for b, (row, m) in enumerate(zip(ids, masks)):
        rect[b, :len(row)], mrect[b, :len(m)] = torch.tensor(row), torch.tensor(m)
    valid = contract.check_mask(rect, mrect)
    contract.check_contiguous(valid, torch.zeros_like(rect))
    keep = [[i for i, v in enumerate(m) if v] for m in masks]
    pick = lambda rows: None if rows is None else tuple(tuple(r[i] for i in k) for r, k in zip(rows, keep))
    return replace(inputs, token_ids=pick(ids), positions=pick(inputs.positions), attention_mask=None)


def resolve_tokens(inputs: Inputs, snapshot: Snapshot) -> tuple[tuple, tuple | None]:
    """Token ids per sample (and the text they came from, if any)."""
    if inputs.token_ids:
        return tuple(tuple(r) for r in inputs.token_ids), None
    prompts = inputs.prompts
    if not prompts:
        if snapshot.tokenizer is None:
            return default_token_ids(snapshot.args.vocab_size), None
        prompts = DEFAULT_TEXT_PROMPTS
    if snapshot.tokenizer is None:
        raise ConfigError(f"text prompts need a tokenizer, and model {snapshot.source} has none "
                          "(give [inputs] token_ids instead)")
    ids = tuple(tuple(snapshot.tokenizer.encode(p)) for p in prompts)
    for p, row in zip(prompts, ids):
        if not row:
            raise ConfigError(f"prompt {p!r} tokenizes to no tokens")
    return ids, tuple(prompts)


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
    if name in ("position-restart", "adapter-mismatch") and (
            run.reuse is None or all(len(t) <= run.reuse.prefix_len for t in tokens)):
        return f"fault:{name} cannot show here: no prompt is longer than the reused prefix"
    return None


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
    return Faults(unmasked_padding=f.name == "unmasked-padding", masked_row_softmax=f.name == "masked-row-softmax",
                  last_column=f.name == "last-column")


def _reuse_meta(engine: Engine, run: RunConfig, tenant: str) -> dict:
    layout = run.cache.layout.resolved(engine.numerical.dtype)
    ident = engine.identity(layout)
    return {**ident, "position_numbering": "absolute, from 0", "mask_semantics": engine.args.attention_rule,
            "tenant": tenant}


def _build_prefixes(engine: Engine, snapshot: Snapshot, run: RunConfig, tokens, positions, segments):
    """The earlier requests: prefill each prompt's first prefix_len tokens into a prefix cache, then look up."""
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
                              torch.tensor([positions[s][:k]]), run.cache)
        kv = PrefixKV([res.kv_cache.stored(layer, 0) for layer in range(snapshot.args.n_layers)],
                      builder.identity(run.cache.layout.resolved(builder.numerical.dtype)))
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


def sample_positions(inputs: Inputs, tokens) -> list[list[int]]:
    """The position descriptor per sample; §2.1(3): it must define every valid position."""
    if inputs.positions is None:
        return [list(range(len(t))) for t in tokens]
    if len(inputs.positions) != len(tokens):
        raise PreconditionError("2.1(3)", "the position descriptor must define every valid position "
                                f"(got {len(inputs.positions)} rows of positions for {len(tokens)} samples)")
    out = []
    for b, (p, t) in enumerate(zip(inputs.positions, tokens)):
        if len(p) < len(t):
            raise PreconditionError("2.1(3)", "the position descriptor must define every valid position "
                                    f"(sample {b}, position {len(p)}: no position id; {len(p)} ids for "
                                    f"{len(t)} tokens)")
        if len(p) > len(t):
            raise PreconditionError("2.1(3)", f"the position descriptor has more ids than the sample has tokens "
                                    f"(sample {b}: {len(p)} ids for {len(t)} tokens)")
        for i, x in enumerate(p):
            if not isinstance(x, int) or isinstance(x, bool):
                raise PreconditionError("2.1(3)", f"position ids must be integers (sample {b}, position {i}: {x!r})")
        out.append(list(p))
    return out


def check_request(tokens, positions, snapshot: Snapshot) -> None:
    """§2.1 (1)-(3) on the logical request, before any prefill call, so errors name the request's samples."""
    n = max(len(t) for t in tokens)
    ids = torch.zeros((len(tokens), n), dtype=torch.long)
    pos = torch.zeros((len(tokens), n), dtype=torch.long)
    valid = torch.zeros((len(tokens), n), dtype=torch.bool)
    for b, (t, p) in enumerate(zip(tokens, positions)):
        ids[b, :len(t)], pos[b, :len(p)], valid[b, :len(t)] = torch.tensor(t), torch.tensor(p), True
    contract.check_ids(ids, valid, snapshot.args.vocab_size)
    contract.check_positions(pos, valid, torch.zeros_like(ids), snapshot.args.max_position)


@dataclass
class Prepared:
    """A side ready to run: snapshot, engine, token ids, and the calls that prefill them."""
    side: Side
    snapshot: Snapshot
    tokens: tuple
    texts: tuple | None
    engine: Engine | None = None
    calls: list = field(default_factory=list)
    record: dict = field(default_factory=dict)

    @property
    def n_cols(self) -> int:
        return max(run.t0 + run.c1 - run.c0 for call in self.calls for run in call.runs)


def prepare(side: Side, snapshot: Snapshot | None = None) -> Prepared:
    """Load the model, tokenize, and plan the prefill calls (including any earlier prefix requests)."""
    snapshot = snapshot or load_snapshot(side.model)
    run = side.run
    side = replace(side, inputs=apply_mask(side.inputs))
    tokens, texts = resolve_tokens(side.inputs, snapshot)
    prep = Prepared(side, snapshot, tokens, texts)
    note = fault_note(run, snapshot, tokens)
    prep.record = {"fault": None if run.fault is None else {"name": run.fault.name, "cannot_show": note},
                   "reuse": None, "invariant_violations": [], "quantized_weights_digest": None}
    set_deterministic(run.numerical.deterministic, compiling=run.numerical.compile)
    budget.check_run(snapshot.args, [len(t) for t in tokens], run.batching != "unbatched")
    positions = sample_positions(side.inputs, tokens)
    pad = _pad_id(side.inputs, snapshot)
    tp = _tp_rank(run, snapshot)
    check_request(tokens, positions, snapshot)  # §2.1 (1)-(3), once, on the request whatever the engine
    rows, samples = [list(t) for t in tokens], list(range(len(tokens)))
    if run.tp > 1 and tp is None:  # the launcher: checked here, before any process starts; each rank prepares
        prep.calls = plan_calls(rows, positions, samples, run.batching, pad)
    elif run.engine in ("transformers", "llama.cpp"):  # a foreign engine runs these calls
        prep.calls = plan_calls(rows, positions, samples, run.batching, pad)
        if run.engine == "llama.cpp":  # refuse what it cannot run before either side does any work
            llamacpp_engine.check_supported(prep)
            llamacpp_engine.load_library()
    else:
        _plan_native(prep, tp, positions, pad)
    return prep


def set_deterministic(mode: bool, compiling: bool) -> None:
    """ATen's deterministic-algorithms flag (warnings, not errors, where an op has no deterministic kernel).

    torch.use_deterministic_algorithms also sets inductor's flag, importing torch._inductor and
    torch._dynamo (seconds of start-up on a busy machine, issue 18): only runs that compile need it.
    """
    if compiling:
        torch.use_deterministic_algorithms(mode, warn_only=True)
    else:
        torch.set_deterministic_debug_mode("warn" if mode else "default")


def _pad_id(inputs: Inputs, snapshot: Snapshot) -> int:
    if inputs.pad_id is not None:
        return inputs.pad_id
    tok = snapshot.tokenizer
    return tok.pad_id if tok is not None and getattr(tok, "pad_id", None) is not None else 0


def _tp_rank(run: RunConfig, snapshot: Snapshot):
    """This process's tensor-parallel context (None when it is not a rank), after checking the run's tp."""
    parallel.check_tp(run.tp, snapshot.args, engine=run.engine, source=snapshot.source, adapter=snapshot.adapter,
                      weight_quant=run.numerical.weight_quant, fault=None if run.fault is None else run.fault.name)
    tp = parallel.current() if run.tp > 1 else None
    if run.tp > 1 and run.numerical.compile:
        raise ConfigError("compile = true and tp > 1 together are not supported (compile one rank's layers, or "
                          "shard an eager model)")
    if tp is not None and tp.world != run.tp:
        raise ConfigError(f"this process is rank {tp.rank} of {tp.world}, but the run asks for tp={run.tp}")
    return tp


def _plan_native(prep: Prepared, tp, positions, pad: int) -> None:
    """Our engine: build it, serve any reused prefixes, plan the calls and their faults."""
    run, snapshot, tokens = prep.side.run, prep.snapshot, prep.tokens
    engine = Engine(snapshot, run.numerical, tp=tp)  # checks §2.1(4) and (5) on the built model
    prep.engine = engine
    prep.record["quantized_weights_digest"] = engine.quantized_digest
    rows, pos, history = [list(t) for t in tokens], positions, {}
    if run.reuse is not None:
        history, outcomes = _build_prefixes(engine, snapshot, run, tokens, positions, prep.side.inputs.segments)
        prep.record["reuse"] = outcomes
        restart = run.fault is not None and run.fault.name == "position-restart"
        for s, kv in history.items():
            k = kv.length
            rows[s] = rows[s][k:]
            pos[s] = list(range(len(rows[s]))) if restart else pos[s][k:]
    prep.calls = plan_calls(rows, pos, list(range(len(tokens))), run.batching, pad, history)
    for call in prep.calls:
        call.faults = faults_for(run, snapshot, call, tokens)


def execute(prep: Prepared, recorder):
    """Run the planned calls in lockstep; yield each completed layer; return the run record."""
    run, L = prep.side.run, prep.snapshot.args.n_layers
    if run.numerical.compile:  # compile every shape the calls will see, timed apart from the recorded run
        prep.record["timing"] = {"compile_s": warm_up(prep)}
    t0 = time.perf_counter()
    gens = [prep.engine.steps(c.ids, c.mask, c.positions, run.cache, segments=c.segments, history=c.history,
                              recorder=Placement(recorder, c.runs, c.samples), faults=c.faults)
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
    if run.numerical.compile:
        prep.record["timing"]["prefill_s"] = time.perf_counter() - t0
    for call, res in zip(prep.calls, results):
        for v in res.cache_metadata["invariant_violations"]:
            prep.record["invariant_violations"].append(f"samples {call.samples}: {v}")
    return prep.record
