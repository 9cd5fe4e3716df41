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

from ..engine.errors import ConfigError, PrefillDiffError, read_small_file
from .tolerance import KINDS, POLICY_ALIASES, TOL_FIELDS, Policy, default_policy, dtype_policy

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
    known = {"base", "equal_nan", "topk", "name", *TOL_FIELDS, *KINDS}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown} (known: {sorted(known)})")
    for k in KINDS:
        if k in raw:
            if not isinstance(raw[k], dict):
                raise ConfigError(f"{path}: [{k}] must be a table with atol and/or rtol")
            bad = sorted(set(raw[k]) - set(TOL_FIELDS))
            if bad:
                raise ConfigError(f"{path}: unknown keys {bad} in [{k}] (known: {', '.join(TOL_FIELDS)})")
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
            if k in raw or any(k in raw.get(kind, {}) for kind in KINDS):
                out[k] = f"file {tolerance_file}"
        if "base" in raw:
            out["base"] = f"file {tolerance_file}"
    if policy:
        out["base"] = "flag"
    out.update({k: "flag" for k, v in fields.items() if v is not None})
    return out


def _exact_rule(tols: dict) -> dict:
    """torch.testing.assert_close's rule: explicit atol/rtol switch off the ntol and row_rtol terms not given."""
    if "atol" in tols or "rtol" in tols:
        return {"ntol": 0.0, "row_rtol": 0.0, **tols}
    return tols


def resolve_policy(spec: dict | None, ref_meta: dict | None = None, cand_meta: dict | None = None,
                   sources: dict | None = None) -> Policy:
    """A Policy from a declared spec; what the spec leaves open follows the traces' dtypes.

    Explicit atol/rtol (top level or per kind) define the element rule exactly as torch.testing.assert_close
    does: the ntol and row_rtol terms are off unless given too. ``sources`` says where the declared terms
    came from (default: 'declared').
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
    for k in KINDS:
        if k in spec and not isinstance(spec[k], dict):
            raise ConfigError(f"tolerance [{k}] must be a table with atol, rtol, ntol or row_rtol (got {spec[k]!r})")
    kinds = {k: _exact_rule(dict(spec[k])) for k in KINDS if k in spec}
    extra = {}
    if "equal_nan" in spec:
        if not isinstance(spec["equal_nan"], bool):
            raise ConfigError(f"equal_nan must be true or false (got {spec['equal_nan']!r})")
        extra["equal_nan"] = spec["equal_nan"]
    if "topk" in spec:
        if not isinstance(spec["topk"], int) or isinstance(spec["topk"], bool) or spec["topk"] < 1:
            raise ConfigError(f"topk must be a positive integer (got {spec['topk']!r})")
        extra["topk"] = spec["topk"]
    if kinds or extra:
        p = p.with_overrides(kinds=kinds, **extra)
    top = _exact_rule({k: spec[k] for k in TOL_FIELDS if spec.get(k) is not None})
    if top:
        p = p.with_overrides(**top)
    for k in TOL_FIELDS:
        if spec.get(k) is not None or any(k in spec.get(kind, {}) for kind in KINDS if isinstance(spec.get(kind),
                                                                                                   dict)):
            src[k] = given.get(k, "declared")
        elif k in top or any(k in v for v in kinds.values()):
            src[k] = "explicit atol/rtol"
    if spec.get("name"):
        p = replace(p, name=str(spec["name"]))
    return replace(p, sources=src)


def default_policy_for(ref_meta: dict, cand_meta: dict) -> Policy:
    """The policy when none is given: the tolerance the reference (a baseline) declares, else the dtype defaults."""
    declared = ref_meta.get("tolerance")
    return resolve_policy(declared, ref_meta, cand_meta,
                          {k: "baseline trace" for k in ("base", *TOL_FIELDS)} if declared else None)
