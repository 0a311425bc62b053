"""Decode context parallelism on paper (SGLang's `--dcp-size`): what splitting a group's KV over its devices buys
and what it costs in collectives, for `python -m jaxdp.plan`.

Inside an attention group of tp devices, MLA's one latent head is replicated on every device: the group holds
one device's worth of context. With `--dcp-size N` (N divides tp), token p's latent lives on device p mod N of
its DCP subgroup, so a device holds 1/N of each sequence and the group N times the tokens. A decode step then
(per layer, over each DCP subgroup of N devices):

1. all-gathers the queries: each device holds its tp's share of the heads; it needs the N subgroup members'
   heads to attend them over its own tokens: [rows, H/tp, kv_lora + rope] from each of N devices;
2. attends those heads over its local tokens, giving partial outputs [rows, N*H/tp, kv_lora] and their
   log-sum-exp [rows, N*H/tp], both float32;
3. all-gathers the log-sum-exps ([N, rows, N*H/tp] gathered; each device rescales its partial output by
   exp(lse_local - lse_total)), and
4. reduce-scatters the rescaled outputs (float32, as `jaxdp.parallel.dcp.SplitContext.attend` sums them) back to
   each device's own heads (the sum over the N token shards).

The buffers are what XLA:GPU's compiled step moves (`plan --compile` lists the step's collectives from its HLO:
docs/dcp.md).

Only the attention core changes; projections, the MoE and the LM head are as without DCP. This module is the
accounting only: the serving engine does not split its pool yet.
"""

from __future__ import annotations

import dataclasses

from jaxdp.config import ModelConfig


class DCPError(ValueError):
    """A --dcp-size the layout cannot take; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class DCPCollective:
    name: str
    op: str
    buffer_bytes: int  # the gathered (or scattered-from) buffer on one device, per layer
    calls: int  # per decode step (one per layer)


def check_dcp(dcp: int, tp: int) -> None:
    """One sentence when `dcp` cannot split a group of `tp` devices."""
    if dcp < 1:
        raise DCPError(f"--dcp-size {dcp} is not a device count; give 1 (off) or a divisor of the group's tp.")
    if dcp > 1 and tp == 1:
        raise DCPError(f"--dcp-size {dcp} splits an attention group's KV over its devices, but each group is one "
                       "device (tp=1); use fewer attention groups (a larger tp) or drop --dcp-size.")
    if tp % dcp:
        raise DCPError(f"--dcp-size {dcp} must divide the attention group's tp={tp}; use a divisor of {tp}.")


def dcp_collectives(cfg: ModelConfig, tp: int, dcp: int, rows: int, act_bytes: int = 2) -> list[DCPCollective]:
    """The extra collectives of one decode step for a group decoding `rows` sequences (the group's rows: every
    device of a group holds them all), per layer, the buffer on one device as the rest of the plan counts it."""
    if dcp == 1:
        return []
    heads = cfg.num_heads // tp * dcp  # the heads one device attends: its subgroup's
    q_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # absorbed queries: latent + rope
    layers = cfg.num_layers
    return [
        DCPCollective("queries", "all-gather", rows * heads * q_dim * act_bytes, layers),
        DCPCollective("log-sum-exp", "all-gather", dcp * rows * heads * 4, layers),  # float32, N gathered
        DCPCollective("partial outputs", "reduce-scatter", rows * heads * cfg.kv_lora_rank * 4, layers),  # float32
    ]


def dcp_summary(cfg: ModelConfig, tp: int, dcp: int, tokens_per_device: int, rows: int) -> dict:
    """KV per device and per group, and the step's extra collectives, for the plan's JSON and its report."""
    colls = dcp_collectives(cfg, tp, dcp, rows)
    return {"size": dcp, "tokens_per_device": tokens_per_device, "tokens_per_group": tokens_per_device * dcp,
            "decode_rows": rows, "collectives": [dataclasses.asdict(c) for c in colls],
            "bytes_per_step": sum(c.buffer_bytes * c.calls for c in colls)}
