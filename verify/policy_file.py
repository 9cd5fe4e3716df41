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
    known = {"base", "equal_nan", "topk", "name", *KINDS}
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


def build_policy(policy: str | None, atol, rtol, tolerance_file, ref_meta: dict | None,
                 cand_meta: dict | None) -> Policy:
    """Flags win over the file; the file wins over the dtype defaults."""
    raw = read_policy_file(tolerance_file) if tolerance_file else {}
    base = policy or raw.get("base")
    if base:
        p = dtype_policy(base)
    else:
        p = default_policy(ref_meta or {}, cand_meta or {})
    kinds = {k: raw[k] for k in KINDS if k in raw}
    extra = {}
    if "equal_nan" in raw:
        if not isinstance(raw["equal_nan"], bool):
            raise ConfigError(f"{tolerance_file}: equal_nan must be true or false")
        extra["equal_nan"] = raw["equal_nan"]
    if "topk" in raw:
        if not isinstance(raw["topk"], int) or raw["topk"] < 1:
            raise ConfigError(f"{tolerance_file}: topk must be a positive integer")
        extra["topk"] = raw["topk"]
    p = p.with_overrides(kinds=kinds, **extra) if kinds or extra else p
    if atol is not None or rtol is not None:
        p = p.with_overrides(atol=atol, rtol=rtol)
    if raw.get("name"):
        from dataclasses import replace
        p = replace(p, name=str(raw["name"]))
    return p
