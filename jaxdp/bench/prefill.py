"""`python -m jaxdp.bench.prefill`: MLA's prompt-path attention, blocked against dense, at DeepSeek-V3's widths.

One layer's prompt attention (latent 512, rope 64, nope 128, value 128; `--heads`: 16 is one rank's share of
DeepSeek-V3's 128 heads under tp=8) over a random paged cache, in three steps of the shapes a server runs:
a fresh prompt, a chunk after a long cached prefix, and a prompt with decoders riding along as one-row
sequences (what every other rank's decoders become in a prompt step). `dense` is the form the prompt path had
(`mla_prompt.attend_dense`: every row against every sequence's whole page table, [T, H, B, C] scores), `blocked`
is the one it has (`mla_prompt.attend_blocked`). Each figure is the median of `--repeats` calls after one
warm-up, the two taking turns; beside the times, XLA's temporary bytes for each (`memory_analysis`), and for
the full-size case (8k rows, 128 heads, 8 sequences, a 64k page table) the bytes alone: dense cannot run there.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.model.mla_prompt import attend_blocked, attend_dense

L, R, N, V = 512, 64, 128, 128
PAGE = 64


def case(name: str, pieces: list[tuple[int, int]], rows: int, width: int, heads: int, seed: int = 0) -> dict:
    """A step of `pieces` (first new position, new rows) padded to `rows`, each sequence's page table
    `width` tokens wide; arrays in bf16 as a server holds them."""
    rng = np.random.default_rng(seed)
    B, per = len(pieces), width // PAGE
    seq = np.concatenate([np.full(n, b) for b, (_, n) in enumerate(pieces)])
    pos = np.concatenate([np.arange(p0, p0 + n) for p0, n in pieces])
    pad = rows - len(seq)
    bf = lambda *s: jnp.asarray(rng.normal(size=s) / 8, jnp.bfloat16)  # noqa: E731
    return dict(name=name, rows=rows, seqs=B, width=width, heads=heads, new_tokens=int(len(seq)),
                context=int(max(p0 + n for p0, n in pieces)),
                args=(bf(rows, heads, N), bf(rows, heads, R), bf(B * per, PAGE, L + R),
                      jnp.asarray(np.arange(B * per).reshape(B, per), jnp.int32),
                      jnp.asarray(np.pad(seq, (0, pad), constant_values=B), jnp.int32),
                      jnp.asarray(np.pad(pos, (0, pad)), jnp.int32), bf(L, heads, N + V)))


def compiled(fn, args):
    jitted = jax.jit(lambda *a: fn(*a, kv_lora_rank=L, softmax_scale=N ** -0.5))
    return jitted.lower(*args).compile()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    H = args.heads
    cases = [case("prompt 1024", [(0, 1024)], 1024, 4096, H),
             case("chunk 512 after 3.5k cached", [(3584, 512)], 512, 4096, H),
             case("prompt 384 + 16 decoders at 512", [(0, 384)] + [(511, 1)] * 16, 512, 4096, H)]
    results = []
    print(f"{'step':<34}{'dense ms':>10}{'blocked ms':>12}{'speed-up':>10}{'dense temp':>12}{'blocked temp':>14}")
    for c in cases:
        fns = {"dense": compiled(attend_dense, c["args"]), "blocked": compiled(attend_blocked, c["args"])}
        times = {k: [] for k in fns}
        outs = {k: np.asarray(f(*c["args"]), np.float32) for k, f in fns.items()}  # warm-up, and the answers
        n = c["new_tokens"]
        err = float(np.abs(outs["dense"][:n] - outs["blocked"][:n]).max())
        for _ in range(args.repeats):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(*c["args"]).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        row = {k: v for k, v in c.items() if k != "args"}
        row.update({f"{k}_ms": 1e3 * float(np.median(v)) for k, v in times.items()})
        row.update({f"{k}_temp_bytes": int(f.memory_analysis().temp_size_in_bytes) for k, f in fns.items()})
        row["max_abs_difference"] = err
        results.append(row)
        print(f"{c['name']:<34}{row['dense_ms']:>10.1f}{row['blocked_ms']:>12.1f}"
              f"{row['dense_ms'] / row['blocked_ms']:>9.1f}x{row['dense_temp_bytes'] / 2**20:>10.0f} MiB"
              f"{row['blocked_temp_bytes'] / 2**20:>10.0f} MiB")
    T, B, C, Hf = 8192, 8, 65536, 128  # the full-size case, shapes only
    sds = jax.ShapeDtypeStruct
    abstract = [sds((T, Hf, N), jnp.bfloat16), sds((T, Hf, R), jnp.bfloat16),
                sds((B * C // PAGE, PAGE, L + R), jnp.bfloat16), sds((B, C // PAGE), jnp.int32),
                sds((T,), jnp.int32), sds((T,), jnp.int32), sds((L, Hf, N + V), jnp.bfloat16)]
    full = dict(name="full size: 8k rows, 8 seqs, 64k", rows=T, seqs=B, width=C, heads=Hf)
    full_row = dict(full)
    for k, fn in (("dense", attend_dense), ("blocked", attend_blocked)):
        full_row[f"{k}_temp_bytes"] = int(compiled(fn, abstract).memory_analysis().temp_size_in_bytes)
    print(f"{full['name']:<34}{'-':>10}{'-':>12}{'':>10}{full_row['dense_temp_bytes'] / 2**30:>10.0f} GiB"
          f"{full_row['blocked_temp_bytes'] / 2**30:>10.1f} GiB")
    out = {"command": "python -m jaxdp.bench.prefill " + " ".join(argv or []), "machine": platform.processor()
           or platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__, "heads": H, "cases": results,
           "full_size": full_row}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
