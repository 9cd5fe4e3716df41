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

from ..engine.errors import ConfigError, PrefillDiffError
from ..engine.untrusted import read_small_file
from .tolerance import KINDS, TOL_FIELDS, Policy, default_policy, dtype_policy

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
    if policy:
        spec["base"] = policy
    for k, v in fields.items():
        if k not in TOL_FIELDS:
            raise TypeError(k)
        if v is not None:
            spec[k] = v
    return spec or None


def resolve_policy(spec: dict | None, ref_meta: dict | None = None, cand_meta: dict | None = None) -> Policy:
    """A Policy from a declared spec; what the spec leaves open follows the traces' dtypes."""
    spec = dict(spec or {})
    base = spec.get("base")
    p = dtype_policy(base) if base else default_policy(ref_meta or {}, cand_meta or {})
    kinds = {k: spec[k] for k in KINDS if k in spec}
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
    if any(spec.get(k) is not None for k in TOL_FIELDS):
        p = p.with_overrides(**{k: spec.get(k) for k in TOL_FIELDS})
    if spec.get("name"):
        from dataclasses import replace
        p = replace(p, name=str(spec["name"]))
    return p
