"""A side made ready to run on its engine: model loaded, requests resolved and checked, calls planned.

``prepare`` does what every engine needs — check that the engine's packages are installed, load the snapshot,
tokenize, check the request against §2.1, check the memory estimate and the tensor-parallel size — then hands
the side to its engine (the registry in engine/registry.py): ``check`` refuses what the engine cannot run,
``plan`` makes its prefill calls. Every path — one sample at a time, a left- or right-padded batch, a packed
row, prefix reuse, chunked — is a list of ``Call``s, each with a ``Placement`` that maps its rows, columns and
sequences onto the trace's coordinates.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import contract, parallel
from .models import budget
from .calls import plan_calls
from .config import Inputs, RunConfig, Side
from .shared.errors import ConfigError, PreconditionError, UnsupportedModel
from .registry import having, missing_packages, refusals
from .models.snapshot import Snapshot
from .models.sources import load_snapshot

# Built-in text prompts: the first two share a preamble of more than one 32-token block and span two blocks on
# SmolLM2's tokenizer (68 and 74 tokens there), so a prefix cache can hit on them; the third is short (5).
_PREAMBLE = ("You are a careful assistant. Read the question below and answer it with a single word: no sentence, "
             "no explanation and nothing else, because your answer will be checked by a program that reads only "
             "the first word you write. ")
DEFAULT_TEXT_PROMPTS = (
    _PREAMBLE + "Question: which city is the capital of the country of France, in Europe? "
                "Answer: The capital of France is",
    _PREAMBLE + "Question: who was the first man to walk on the moon, in 1969? Answer: The first man on the moon was",
    "Hello, my name is",
)
# Built-in token prompts: two span two or more 32-token blocks (vLLM's CPU block size) and share their first
# block, so a prefix cache can hit on them; one is short.
DEFAULT_LENGTHS = (70, 45, 9)
DEFAULT_SHARED = 32


def default_token_ids(vocab_size: int, lengths=DEFAULT_LENGTHS, shared: int = 0) -> tuple:
    """Built-in prompts of unequal lengths for models without a tokenizer; seeded, never id 0 (the pad id).

    With ``shared``, the second prompt begins with the first prompt's first ``shared`` tokens.
    """
    g = torch.Generator().manual_seed(2024)
    rows = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]
    if shared and len(rows) > 1:
        k = min(shared, len(rows[0]), len(rows[1]))
        rows[1][:k] = rows[0][:k]
    return tuple(tuple(r) for r in rows)


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
            return default_token_ids(snapshot.args.vocab_size, shared=DEFAULT_SHARED), None
        prompts = DEFAULT_TEXT_PROMPTS
    if snapshot.tokenizer is None:
        raise ConfigError(f"text prompts need a tokenizer, and model {snapshot.source} has none "
                          "(give [inputs] token_ids instead)")
    ids = tuple(tuple(snapshot.tokenizer.encode(p)) for p in prompts)
    for p, row in zip(prompts, ids):
        if not row:
            raise ConfigError(f"prompt {p!r} tokenizes to no tokens")
    return ids, tuple(prompts)


def greedy_response(side: Side, n: int) -> tuple:
    """Each sample's response of ``n`` tokens as ``side``'s engine chooses it, greedily (argmax), from its prompt
    alone: what a rollout engine would have written (``--response-tokens``). The engine must declare ``generates``."""
    info = side.run.info
    if not info.generates:
        raise ConfigError(f"--response-tokens: {info.words} does not choose tokens ({having('generates')} does): "
                          "give the response instead (--response, --response-ids)")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
        raise ConfigError(f"--response-tokens must be an integer from 1 to 4096 (got {n!r})")
    prompts = replace(side.inputs, responses=None, response_texts=(), response_tokens=None)
    prep = prepare(replace(side, inputs=prompts, run=replace(side.run, decode=False, fault=None)))
    return info.load().generate(prep, n)


def resolve_responses(inputs: Inputs, snapshot: Snapshot, n_samples: int) -> tuple | None:
    """Each sample's response token ids (None when the inputs give none): ids as given, or texts tokenized as
    prompts are; one per sample, or one for every sample."""
    if inputs.responses is None and not inputs.response_texts:
        return None
    if inputs.responses is not None:
        rows = tuple(tuple(r) for r in inputs.responses)
    elif snapshot.tokenizer is None:
        raise ConfigError(f"response texts need a tokenizer, and model {snapshot.source} has none "
                          "(give [inputs] responses as token ids instead)")
    else:
        rows = tuple(tuple(snapshot.tokenizer.encode(t)) for t in inputs.response_texts)
    if len(rows) == 1 and n_samples > 1:
        rows = rows * n_samples
    if len(rows) != n_samples:
        raise ConfigError(f"a response must be given for every sample, or one for all (got {len(rows)} responses "
                          f"for {n_samples} samples)")
    for b, r in enumerate(rows):
        if not r:
            raise ConfigError(f"the response of sample {b} is empty (a response needs at least one token)")
    return rows


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
    engine: object | None = None  # what the engine's plan built, if it keeps one (ours: prefill.Engine)
    calls: list = field(default_factory=list)
    record: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)  # what an engine's plan resolved for its execute (never recorded)
    routing: dict = field(default_factory=dict)  # routing replay: {layer: {(sample, token index): experts}} to force
    prompt_lengths: tuple = ()  # per sample, its prompt's tokens; ``tokens`` beyond them are its response

    @property
    def n_cols(self) -> int:
        return max(run.t0 + run.c1 - run.c0 for call in self.calls for run in call.runs)


def prepare(side: Side, snapshot: Snapshot | None = None, routing: dict | None = None) -> Prepared:
    """Load the model, tokenize, and plan the prefill calls (including any earlier prefix requests). ``routing``:
    experts to force, {layer: {(sample, token index): experts}} (routing replay), known before planning because
    a reused prefix is prefilled then."""
    run = side.run
    missing_packages(run.info)  # an engine's missing package is said before any model loads
    snapshot = snapshot or load_snapshot(side.model)
    if snapshot.foreign is not None and not run.info.any_architecture:
        raise UnsupportedModel(f"{snapshot.foreign} (only {having('any_architecture')} runs a model our engine does "
                               "not implement)")
    side = replace(side, inputs=apply_mask(side.inputs))
    tokens, texts = resolve_tokens(side.inputs, snapshot)
    responses = resolve_responses(side.inputs, snapshot, len(tokens))
    prompt_lengths = tuple(len(t) for t in tokens)
    if responses is not None:
        tokens = tuple(t + r for t, r in zip(tokens, responses))
        if texts is not None and side.inputs.response_texts:
            said = side.inputs.response_texts
            texts = tuple(p + r for p, r in zip(texts, said * len(tokens) if len(said) == 1 else said))
    prep = Prepared(side, snapshot, tokens, texts)
    prep.prompt_lengths = prompt_lengths
    prep.routing = routing or {}
    prep.record = {"fault": None if run.fault is None else {"name": run.fault.name, "cannot_show": None},
                   "reuse": None, "invariant_violations": [], "quantized_weights_digest": None, "prefill": None}
    set_deterministic(run.deterministic, compiling=False)  # an engine that compiles sets it again (ours)
    budget.check_run(snapshot.args, [len(t) for t in tokens], run.batching != "unbatched")
    positions = sample_positions(side.inputs, tokens)
    pad = _pad_id(side.inputs, snapshot)
    tp = _tp_rank(run, snapshot)
    check_request(tokens, positions, snapshot)  # §2.1 (1)-(3), once, on the request whatever the engine
    refuse_unsupported(prep, positions)
    if run.tp > 1 and responses is not None:
        raise ConfigError("a response (prompt + response, decode) with tp > 1 is not supported: rank traces do not "
                          "hold a response's logits; run it on one process (tp = 1)")
    if run.decode and responses is None:
        raise ConfigError("decode = true writes a response token by token: give one (--response TEXT or "
                          "[inputs] responses)")
    if responses is not None:
        prep.record["response"] = {"chosen_by": side.inputs.response_chosen_by or "given", "samples": [
            {"sample": s, "prompt": p, "response": len(t) - p} for s, (t, p) in enumerate(zip(tokens, prompt_lengths))]}
    engine = run.info.load()
    engine.check(prep)  # what the engine cannot run is refused before either side does any work
    if run.tp > 1 and tp is None:  # the launcher: checked here, before any process starts; each rank plans
        prep.calls = plan_calls([list(t) for t in tokens], positions, list(range(len(tokens))), run.batching, pad)
    else:
        engine.plan(prep, positions, pad, tp)
        if run.info.prefill_steps == "plan":
            prep.record["prefill"] = planned_prefill(prep)
    return prep


def refuse_unsupported(prep: Prepared, positions) -> None:
    """Refuse, in one line naming the engine and each capability, what the run asks that its engine does not
    declare (engine/registry.py ``refusals``): a fault it cannot inject first, then everything else at once."""
    run, info = prep.side.run, prep.side.run.info
    if run.fault is not None and run.fault.name not in info.faults:
        can = ", ".join(info.faults) or "none"
        raise ConfigError(f"the {run.engine} engine cannot inject fault {run.fault.name} (it injects: {can})")
    given = any(list(p) != list(range(len(t))) for p, t in zip(positions, prep.tokens))
    no = refusals(info, run, prep.snapshot.args, prep.snapshot.adapter is not None, given,
                  any(len(t) > p for t, p in zip(prep.tokens, prep.prompt_lengths)))
    if no:
        raise ConfigError(f"{info.words} does not run " + "; ".join(no))


def planned_prefill(prep: Prepared) -> dict:
    """Each sample's prefill as its planned calls compute it (the trace's ``record.prefill``): tokens served from
    a reused prefix, tokens computed, and the forward steps computing them — one per call, or per chunk of
    ``chunk_size`` columns of a chunked call (``token_budget``: tokens of each sample a step computes)."""
    chunk = prep.side.run.chunk_size or None
    samples = {s: {"sample": s, "tokens": len(t), "from_cache": 0, "computed": 0, "steps": 0}
               for s, t in enumerate(prep.tokens)}
    for call in prep.calls:
        width = min(chunk or call.ids.shape[1], call.ids.shape[1])
        for r, c0, c1, s, _ in call.runs:
            cols = (torch.nonzero(call.mask[r, c0:c1]).flatten() + c0).tolist()  # its valid columns
            prefix = call.history.get(call.samples.index(s))
            rec = samples[s]
            rec["from_cache"] += 0 if prefix is None else prefix.length
            rec["computed"] += len(cols)
            rec["steps"] += len({c // width for c in cols})
    return {"token_budget": chunk, "budget_per": "sample" if chunk else None, "samples": list(samples.values())}


def set_deterministic(mode: bool, compiling: bool) -> None:
    """ATen's deterministic-algorithms flag (warnings, not errors, where an op has no deterministic kernel).

    torch.use_deterministic_algorithms also sets inductor's flag, importing torch._inductor and
    torch._dynamo (seconds of start-up on a busy machine): only runs that compile need it.
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
    if run.tp != 1 and not run.info.tp and isinstance(run.tp, int):
        raise ConfigError(f"the {run.engine} engine does not shard over tensor-parallel ranks ({run.info.no_tp}): "
                          f"tp must be 1 (got tp={run.tp})")
    parallel.check_tp(run.tp, snapshot.args, adapter=snapshot.adapter, weight_quant=run.weight_quant,
                      fault=None if run.fault is None else run.fault.name)
    tp = parallel.current() if run.tp > 1 else None
    if tp is not None and tp.world != run.tp:
        raise ConfigError(f"this process is rank {tp.rank} of {tp.world}, but the run asks for tp={run.tp}")
    return tp
