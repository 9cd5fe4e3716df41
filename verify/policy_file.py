"""Resolve a tolerance policy from flags and an optional TOML policy file.

Policy file (every key optional; unknown keys are errors)::

    base = "float32"          # start from this dtype's defaults (default: from the traces)
    equal_nan = false         # NaN at the same place on both sides counts as agreement
    topk = 5                  # top-ranked ids compared
    [residual]                # one table per kind: residual, attn_update, mlp_update,
    atol = 1e-4               #   cache_keys, cache_values, logits
    rtol = 1e-4
"""
from __future__ import annotations

from ..engine.errors import ConfigError
from .tolerance import KINDS, Policy, default_policy, dtype_policy

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def read_policy_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such tolerance file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read tolerance file ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    known = {"base", "equal_nan", "topk", "name", "atol", "rtol", *KINDS}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown} (known: {sorted(known)})")
    for k in KINDS:
        if k in raw:
            if not isinstance(raw[k], dict):
                raise ConfigError(f"{path}: [{k}] must be a table with atol and/or rtol")
            bad = sorted(set(raw[k]) - {"atol", "rtol"})
            if bad:
                raise ConfigError(f"{path}: unknown keys {bad} in [{k}] (known: atol, rtol)")
    return raw


def policy_spec(policy: str | None = None, atol=None, rtol=None, tolerance_file=None) -> dict | None:
    """The declared tolerance as plain data (flags over file), or None if nothing was declared."""
    raw = read_policy_file(tolerance_file) if tolerance_file else {}
    spec = {k: v for k, v in raw.items()}
    if policy:
        spec["base"] = policy
    if atol is not None:
        spec["atol"] = atol
    if rtol is not None:
        spec["rtol"] = rtol
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
    if spec.get("atol") is not None or spec.get("rtol") is not None:
        p = p.with_overrides(atol=spec.get("atol"), rtol=spec.get("rtol"))
    if spec.get("name"):
        from dataclasses import replace
        p = replace(p, name=str(spec["name"]))
    return p
