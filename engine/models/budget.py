"""Memory estimates, checked before anything is allocated.

A config (or a baseline trace's model spec) can ask for ``dim = 2**40`` or ``n_layers = 100000``; building that
model ends in an allocation error deep inside torch, or runs for minutes before failing. The model's and the
run's memory are estimated from the arguments alone and compared with the memory this machine has available
now; a request over the limit is refused with both numbers. ``--ignore-memory-estimate`` turns the check off
for people who know better (swap, an estimate that is too cautious for their model).
"""
from __future__ import annotations

import os

from ..shared.errors import ConfigError

CHECK = {"enabled": True}  # set False by the CLI's --ignore-memory-estimate
MASTER_BYTES = 4  # float32 master weights
HEADROOM = 0.9  # of the available memory a request may use


def param_count(args) -> int:
    """Parameters of a Llama-family model with these ModelArgs (engine/native/model.py's Transformer)."""
    d, L, hq, hkv, dh, hid, V = (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim,
                                 args.hidden_dim, args.vocab_size)
    attn = d * hq * dh + 2 * d * hkv * dh + hq * dh * d + ((hq + 2 * hkv) * dh if args.qkv_bias else 0)
    attn += (d if args.o_bias else 0) + {"head": 2 * dh, "proj": (hq + hkv) * dh}.get(args.qk_norm, 0)
    norms = 4 if args.norm_placement == "sandwich" else 2  # Gemma's sandwich: a norm before and after each
    dense = 3 * d * hid + ((2 * hid + d) if args.mlp_bias else 0)
    E = getattr(args, "n_experts", 0)
    moe = E * (d + 3 * d * args.moe_hidden_dim) + (3 * d * args.shared_expert_dim + d if args.shared_expert_dim
                                                    else 0) if E else dense
    n_moe = L - len(set(args.dense_layers)) if E else 0  # no loop over layers: L may be a hostile 10**8
    per_layer = attn + norms * d
    head = 0 if args.tie_embeddings else V * d
    return V * d + L * per_layer + n_moe * moe + (L - n_moe) * dense + d + head + (V if args.lm_head_bias else 0)


def model_bytes(args) -> int:
    """The float32 master weights plus one built copy (at most float64)."""
    return param_count(args) * (MASTER_BYTES + 8)


def run_bytes(args, lengths, batched: bool) -> int:
    """Activations of one prefill call over these prompt lengths, float64 at most: the residual stream and its
    sub-layer states, the MLP's hidden activations, attention scores (query heads x T x T) and logits."""
    n = sum(lengths)
    T = max(lengths) if lengths else 0
    rows = len(lengths) * T if batched else T
    per_token = 8 * args.dim + 3 * args.hidden_dim + 2 * args.n_heads * args.head_dim
    scores = (len(lengths) if batched else 1) * args.n_heads * T * T
    cache = 2 * args.n_layers * n * args.n_kv_heads * args.head_dim
    return 8 * (rows * per_token + 2 * scores + cache + len(lengths) * args.vocab_size)


def available_bytes() -> int | None:
    """Memory available to this process now: MemAvailable, or less where the cgroup's limit less its use, or the
    address space left under RLIMIT_AS, is smaller."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                avail = min(avail, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    space = address_space_left()
    return avail if space is None else min(avail, space)


def address_space_left() -> int | None:
    """The address space this process may still map under RLIMIT_AS (``ulimit -v``, ``prlimit --as``): the soft
    limit less the VmSize it has mapped already; None when there is no limit."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    except (OSError, ValueError):
        size = 0
    return max(0, soft - size)


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g} GiB" if n < 2 ** 70 else f"2^{n.bit_length() - 1} bytes"


def check(what: str, need: int, detail: str) -> None:
    """Refuse a request estimated to need more than the available memory (unless the check is off)."""
    if not CHECK["enabled"]:
        return
    avail = available_bytes()
    if avail is None or need <= HEADROOM * avail:
        return
    space = address_space_left()
    where = "this process may still map under its address-space limit (RLIMIT_AS)" if space is not None and \
        space <= avail else "this machine has available"
    raise ConfigError(f"{what} needs about {_gib(need)} of memory ({detail}), more than the "
                      f"{_gib(int(HEADROOM * avail))} {where}; refused before allocating "
                      "(--ignore-memory-estimate to try anyway)")


def check_model(args, source: str) -> None:
    p = param_count(args)
    check(f"model {source}", model_bytes(args),
          f"estimate: {p:,} parameters from dim={args.dim}, n_layers={args.n_layers}, hidden_dim={args.hidden_dim}, "
          f"vocab_size={args.vocab_size}")


def check_run(args, lengths, batched: bool) -> None:
    check("this prefill", run_bytes(args, lengths, batched),
          f"estimate: {len(lengths)} prompts of up to {max(lengths)} tokens on a model of dim={args.dim}, "
          f"{args.n_layers} layers")
