"""Resolve a tolerance policy from flags and an optional TOML policy file.

Policy file (every key optional; unknown keys are errors)::

    base = "float32"          # start from this dtype's defaults (default: from the traces)
    equal_nan = false         # NaN at the same place on both sides counts as agreement
    topk = 5                  # top-ranked ids compared
    [residual]                # one table per kind: residual, attn_update, mlp_update,
    atol = 1e-4               #   cache_keys, cache_values, logits
    rtol = 1e-4
    ntol = 1e-3               # times the RMS of the reference vector at that position
    row_rtol = 0.0            # a row within this relative L2 error passes whole (0: off)
"""
from __future__ import annotations

from dataclasses import replace

from ..dumps.schema import TOL_FIELDS, TOL_KINDS
from ..engine.shared.errors import ConfigError, PrefillDiffError, did_you_mean
from ..engine.shared.untrusted import read_small_file
from .tolerance import POLICY_ALIASES, Policy, default_policy, dtype_policy

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def read_policy_file(path: str) -> dict:
    try:
        raw = tomllib.loads(read_small_file(path, "tolerance file").decode("utf-8"))
    except PrefillDiffError as e:  # missing, not a regular file (FIFO, device), or over the size limit
        raise ConfigError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read tolerance file ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    keys = ("base", "equal_nan", "topk", "name", *TOL_FIELDS)
    for k in sorted(set(raw) - set(keys) - set(TOL_KINDS)):
        if isinstance(raw[k], dict):  # a table: a tensor kind's
            raise ConfigError(f"{path}: unknown table [{k}]{did_you_mean(k, TOL_KINDS, ' (did you mean [{}]?)')} "
                              f"(tables: {', '.join(f'[{kind}]' for kind in TOL_KINDS)})")
        raise ConfigError(f"{path}: unknown key {k}{did_you_mean(k, keys + TOL_KINDS)} (keys: {', '.join(keys)}; "
                          f"tables: {', '.join(f'[{kind}]' for kind in TOL_KINDS)})")
    for k in TOL_KINDS:
        if k in raw:
            if not isinstance(raw[k], dict):
                raise ConfigError(f"{path}: [{k}] must be a table with atol and/or rtol")
            for bad in sorted(set(raw[k]) - set(TOL_FIELDS)):
                raise ConfigError(f"{path}: unknown key [{k}] {bad}{did_you_mean(bad, TOL_FIELDS)} "
                                  f"(keys: {', '.join(TOL_FIELDS)})")
    return raw


def policy_spec(policy: str | None = None, tolerance_file=None, **fields) -> dict | None:
    """The declared tolerance as plain data (flags over file), or None if nothing was declared.

    fields: atol, rtol, ntol, row_rtol for every kind (None: not given).
    """
    spec = dict(read_policy_file(tolerance_file)) if tolerance_file else {}
    if isinstance(spec.get("base"), str):
        spec["base"] = POLICY_ALIASES.get(spec["base"], spec["base"])
    if policy:
        spec["base"] = POLICY_ALIASES.get(policy, policy)  # a preset name (bf16) is stored as its dtype
    for k, v in fields.items():
        if k not in TOL_FIELDS:
            raise TypeError(k)
        if v is not None:
            spec[k] = v
    return spec or None


def spec_sources(policy: str | None = None, tolerance_file=None, **fields) -> dict:
    """Where each declared term came from: 'flag' or 'file PATH' (for the report's header)."""
    out = {}
    if tolerance_file:
        raw = read_policy_file(tolerance_file)
        for k in TOL_FIELDS:
            if k in raw or any(k in raw.get(kind, {}) for kind in TOL_KINDS):
                out[k] = f"file {tolerance_file}"
        if "base" in raw:
            out["base"] = f"file {tolerance_file}"
        out["table"] = f"file {tolerance_file}"  # where the per-kind tables come from
    if policy:
        out["base"] = "flag"
    out.update({k: "flag" for k, v in fields.items() if v is not None})
    return out


def _kind_terms(spec: dict, kind: str, flags: set) -> tuple[dict, dict]:
    """One kind's declared terms and where each came from ('top': the top level, 'table': the kind's own table,
    'exact': switched off by explicit atol/rtol). A kind's table refines the file's top level; a flag wins over
    both. Explicit atol/rtol define torch.testing.assert_close's rule: ntol and row_rtol are off unless given
    too (at the top level or in the kind's table)."""
    table = spec.get(kind) or {}
    terms, where = {}, {}
    for k in TOL_FIELDS:
        top = spec.get(k)
        if k in table and not (top is not None and k in flags):
            terms[k], where[k] = table[k], "table"
        elif top is not None:
            terms[k], where[k] = top, "top"
    if "atol" in terms or "rtol" in terms:
        for k in ("ntol", "row_rtol"):
            if k not in terms:
                terms[k], where[k] = 0.0, "exact"
    return terms, where


def resolve_policy(spec: dict | None, ref_meta: dict | None = None, cand_meta: dict | None = None,
                   sources: dict | None = None) -> Policy:
    """A Policy from a declared spec; what the spec leaves open follows the traces' dtypes.

    Explicit atol/rtol (top level or per kind) define the element rule exactly as torch.testing.assert_close
    does: the ntol and row_rtol terms are off unless given too. ``sources`` says where the declared terms
    came from ('flag', 'file PATH'; default: 'declared'); flags win over a file's per-kind tables.
    """
    spec = dict(spec or {})
    base = spec.get("base")
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"tolerance base must be a dtype name (got {base!r})")
    p = dtype_policy(base) if base else default_policy(ref_meta or {}, cand_meta or {})
    src = dict(p.sources)
    given = dict(sources or {})
    if base:
        src = {k: f"{p.name} default" + (f", base from {given['base']}" if given.get("base") else "")
               for k in TOL_FIELDS}
    for k in TOL_KINDS:
        if k in spec and not isinstance(spec[k], dict):
            raise ConfigError(f"tolerance [{k}] must be a table with atol, rtol, ntol or row_rtol (got {spec[k]!r})")
    flags = {k for k, v in given.items() if v == "flag"}
    kinds, shown = {}, {}
    for k in TOL_KINDS:
        kinds[k], where = _kind_terms(spec, k, flags)
        if k == "residual":  # the header shows the residual kind's terms: say where each came from
            shown = where
    extra = {}
    if "equal_nan" in spec:
        if not isinstance(spec["equal_nan"], bool):
            raise ConfigError(f"equal_nan must be true or false (got {spec['equal_nan']!r})")
        extra["equal_nan"] = spec["equal_nan"]
    if "topk" in spec:
        if not isinstance(spec["topk"], int) or isinstance(spec["topk"], bool) or spec["topk"] < 1:
            raise ConfigError(f"topk must be a positive integer (got {spec['topk']!r})")
        extra["topk"] = spec["topk"]
    kinds = {k: v for k, v in kinds.items() if v}
    if kinds or extra:
        p = p.with_overrides(kinds=kinds, **extra)
    table_src = given.get("table", "declared")
    for k, w in shown.items():
        src[k] = {"top": given.get(k, "declared"), "table": f"{table_src} [residual]",
                  "exact": "explicit atol/rtol"}[w]
    if spec.get("name"):
        p = replace(p, name=str(spec["name"]))
    return replace(p, sources=src)


def default_policy_for(ref_meta: dict, cand_meta: dict) -> Policy:
    """The policy when none is given: the tolerance the reference (a baseline) declares, else the dtype defaults."""
    declared = ref_meta.get("tolerance")
    return resolve_policy(declared, ref_meta, cand_meta,
                          {k: "baseline trace" for k in ("base", "table", *TOL_FIELDS)} if declared else None)
