"""`python -m jaxdp.training.train`: train the embedded default model on the project's own skills data.

The forward pass is the inference code itself: a batch is `--groups` packed groups of `--rows` token
rows (whole sequences back to back), each group one flat step of the decoder without a cache (a
sequence's context is its own rows; logits for every row; `LocalComm(dense_experts=True)`, the routed
experts as one dense product, since ragged_dot does not batch), the groups side by side with `vmap`.
AdamW with warmup and a cosine decay, data through grain (`jaxdp.training.data`), a tqdm bar and a JSON-lines
loss log, orbax training checkpoints, and at the end an export in the Hugging Face format
`--model-path` reads (`save_hf_checkpoint` plus the tokenizer files). Deterministic given `--seed`
(initial weights and data stream).

    python -m jaxdp.training.train --seed 0 --out runs/default-model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jaxdp.config import PRESETS, ModelConfig
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.loader import load_model, load_mtp, model_config, save_hf_checkpoint
from jaxdp.model.mla import AttnBatch
from jaxdp.model.mtp import MTPLayer
from jaxdp.parallel.local import LocalComm
from jaxdp.tokenizer import Tokenizer, save_default_tokenizer
from jaxdp.training.data import (
    ARITHMETIC,
    LONG,
    SKILL_WEIGHTS,
    SKILLS,
    PackShape,
    format_mix,
    held_out_problems,
    pack_group,
    parse_mix,
    prompt_text,
    train_batches,
)
from jaxdp.training.eval import evaluate_local

log = logging.getLogger("jaxdp.training.train")

# The shipped default model: the tiny preset, wider (its cost on a CPU is overhead-bound, so width is cheap)
# max_position_embeddings only sets the context a server offers (the skills are short; rope is unscaled)
DEFAULT_OVERRIDES = ["hidden_size=256", "intermediate_size=512", "q_lora_rank=64", "kv_lora_rank=64",
                     "qk_rope_head_dim=16", "max_position_embeddings=512"]


def parse_overrides(items: list[str], cfg: ModelConfig) -> ModelConfig:
    """`hidden_size=128 num_layers=4` -> cfg.with_(...), each value parsed as the field's type."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    kw: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--config-overrides {item!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(fields)}")
        current = getattr(cfg, key)
        if value.lower() == "none":
            kw[key] = None
        else:
            kw[key] = type(current)(value) if current is not None else int(value)
    return cfg.with_(**kw)


def flat_logits(model: DeepseekV3, group: dict[str, jax.Array], mtp: MTPLayer | None = None, mtp_steps: int = 1):
    """Logits [R, V] of one packed group (`jaxdp.training.data.pack_group`), run as one flat step of the decoder
    without a cache: each sequence attends to its own rows; padding rows route to no expert. With `mtp`, also
    the MTP layer's logits [mtp_steps, R, V], the draft chain unrolled: pass 1 reads at row r the model's final
    normed hidden state of row r and the next token of the sequence (row r's label) and predicts the one after
    (`mtp_targets`); pass s > 1 reads at row r its own previous pass's output of row r - 1 after
    `mtp.shared_norm` (a draft step's hidden state, SGLang's chain) with the same token, and predicts the same
    target. (The chain's context is approximate: pass s attends to pass s's rows, where a draft step attends
    to the draft KV of the accepted rows, written by pass 1; `jaxdp.training.eval.accept_lengths` measures the
    exact chain.)"""
    max_seqs = group["seq_lens"].shape[0]
    R = group["tokens"].shape[0]
    batch = AttnBatch(positions_T=group["positions"], seq_T=group["seq"])
    valid, rows, comm = group["seq"] < max_seqs, jnp.arange(R, dtype=jnp.int32), LocalComm(dense_experts=True)
    logits, _, _, hidden = model(group["tokens"], valid, batch, None, rows, comm, absorbed=False, return_hidden=True)
    if mtp is None:
        return logits
    embed, head, h = model.embed_VD[...], model.lm_head_weight(), hidden
    passes = []
    for _ in range(mtp_steps):
        mtp_logits, x, _, _ = mtp(group["labels"], h, valid, batch, None, rows, comm, embed, head, absorbed=False)
        passes.append(mtp_logits)
        h = jnp.concatenate([hidden[:1], mtp.shared_norm(x)[:-1]])  # row r reads row r - 1's draft state
    return logits, jnp.stack(passes)


def mtp_targets(group: dict[str, jax.Array], steps: int = 1) -> tuple[jax.Array, jax.Array]:
    """What the MTP layer must predict at each row of a packed group, and where it counts: the token two
    ahead in the same sequence (row r + 1's label), weighted as the main loss weights that token; the weights
    per chain pass [steps, R] (pass s counts at row r only when its chain began in the same sequence, at row
    r - s + 1)."""
    seq = group["seq"]
    same = jnp.concatenate([seq[1:] == seq[:-1], jnp.zeros((1,), bool)])
    labels = jnp.concatenate([group["labels"][1:], group["labels"][-1:]])
    mask = jnp.where(same, jnp.concatenate([group["loss_mask"][1:], jnp.zeros((1,), group["loss_mask"].dtype)]), 0.0)
    masks = [mask]
    for s in range(1, steps):
        began_here = jnp.concatenate([jnp.zeros((s,), bool), seq[s:] == seq[:-s]])
        masks.append(jnp.where(began_here, mask, 0.0))
    return labels, jnp.stack(masks)


class Trainer:
    """The model split into (graph, trainable params, the rest) and the jitted steps over them. With
    `mtp_weight` > 0 an MTP layer (`jaxdp.model.mtp`, DeepSeek-V3's multi-token prediction) trains with it,
    jointly: its loss (the token two ahead) times `mtp_weight` is added to the model's (DeepSeek-V3 used 0.3,
    then 0.1); it shares the model's embedding and head, and its gradient reaches the model's hidden states.
    With `mtp_steps` > 1 the draft chain is unrolled that many passes (`flat_logits`), their losses averaged."""

    def __init__(self, cfg: ModelConfig, seed: int, shape: PackShape,
                 optimizer: optax.GradientTransformation, mtp_weight: float = 0.0, mtp_steps: int = 1):
        model = DeepseekV3(cfg, nnx.Rngs(seed), jnp.float32)
        self.cfg, self.shape, self.mtp_weight, self.mtp_steps = cfg, shape, mtp_weight, mtp_steps
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = nnx.to_pure_dict(params)
        self._template = params
        if mtp_weight > 0:  # its own seed, so the model's initial weights are those of a run without it
            mtp = MTPLayer(cfg, nnx.Rngs(seed + 1), jnp.float32)
            self.mtp_graphdef, mtp_params, self.mtp_rest = nnx.split(mtp, nnx.Param, ...)
            self._mtp_template = mtp_params
            self.params = {"model": self.params, "mtp": nnx.to_pure_dict(mtp_params)}
        self.optimizer = optimizer
        self.opt_state = optimizer.init(self.params)
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1))
        self.logits = jax.jit(self._logits)

    def init_model_from(self, model: DeepseekV3, mtp: MTPLayer | None = None) -> None:
        """Start the model (and, given one, the MTP layer) from these weights (`--init-from`: a later stage)."""

        def take(module: nnx.Module, mine: dict) -> dict:
            given = nnx.to_pure_dict(nnx.state(module, nnx.Param))
            shapes = jax.tree.map(lambda a: a.shape, mine)
            same = jax.tree.structure(given) == jax.tree.structure(mine)
            if not same or jax.tree.map(lambda a: a.shape, given) != shapes:
                raise ValueError("--init-from: the checkpoint's shape differs from --preset and --config-overrides")
            return jax.tree.map(lambda a, b: jnp.asarray(np.asarray(a), b.dtype), given, mine)  # as the init made them

        if self.mtp_weight > 0:
            self.params = {"model": take(model, self.params["model"]),
                           "mtp": self.params["mtp"] if mtp is None else take(mtp, self.params["mtp"])}
        else:
            self.params = take(model, self.params)
        self.opt_state = self.optimizer.init(self.params)

    def model(self, params: dict) -> DeepseekV3:
        state = jax.tree.map(lambda x: x, self._template)
        nnx.replace_by_pure_dict(state, params["model"] if self.mtp_weight > 0 else params)
        return nnx.merge(self.graphdef, state, self.rest)

    def mtp(self, params: dict) -> MTPLayer | None:
        if self.mtp_weight <= 0:
            return None
        state = jax.tree.map(lambda x: x, self._mtp_template)
        nnx.replace_by_pure_dict(state, params["mtp"])
        return nnx.merge(self.mtp_graphdef, state, self.mtp_rest)

    def _logits(self, params: dict, batch: dict[str, jax.Array]):
        """Logits [G, R, V] of a batch of G packed groups, side by side (with the MTP layer: and its logits)."""
        model, mtp = self.model(params), self.mtp(params)
        return jax.vmap(lambda g: flat_logits(model, g, mtp, self.mtp_steps))(batch)

    def _loss(self, params: dict, batch: dict[str, jax.Array]) -> jax.Array:
        logits = self._logits(params, batch)
        if self.mtp_weight > 0:
            logits, mtp_logits = logits
            labels, masks = jax.vmap(lambda g: mtp_targets(g, self.mtp_steps))(batch)  # [G, R], [G, K, R]
            ce = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, labels[:, None])  # [G, K, R]
            mtp_loss = ((ce * masks).sum((0, 2)) / jnp.maximum(masks.sum((0, 2)), 1.0)).mean()
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        mask = batch["loss_mask"]
        loss = (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        return loss + self.mtp_weight * mtp_loss if self.mtp_weight > 0 else loss

    def _train_step(self, params, opt_state, batch):
        loss, grads = jax.value_and_grad(self._loss)(params, batch)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    def greedy(self, prompts: list[list[int]], max_new: int, eos_id: int, pad_id: int) -> list[list[int]]:
        """Greedy continuations, recomputing every sequence for each new token (evaluation in training):
        groups of 8 sequences packed back to back."""
        L, per_group = self.shape.max_len, 8
        seqs = [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        active = [True] * len(prompts)
        for _ in range(max_new):
            groups = []
            for start in range(0, len(seqs), per_group):
                g = pack_group([(s, [0.0] * len(s)) for s in seqs[start:start + per_group]],
                               PackShape(per_group * L, per_group, L), pad_id)
                groups.append(g)
            batch = {k: jnp.asarray(np.stack([g[k] for g in groups])) for k in groups[0]}
            logits = self.logits(self.params, batch)
            logits = np.asarray(logits[0] if self.mtp_weight > 0 else logits)
            ends = [sum(len(x) for x in seqs[i - i % per_group:i + 1]) - 1 for i in range(len(seqs))]
            for i, s in enumerate(seqs):
                if not active[i]:
                    continue
                nxt = int(logits[i // per_group, ends[i]].argmax())  # the row of its last token
                out[i].append(nxt)
                active[i] = nxt != eos_id and len(s) + 1 < L
                s.append(nxt)
            if not any(active):
                break
        return out


def quick_eval(trainer: Trainer, tok: Tokenizer, n_per_skill: int, chat: bool = True) -> dict[str, float]:
    """Greedy accuracy per short skill on the held-out split, through the training forward (recomputing every
    sequence for each token: the check during training; the long skills wait for the final check)."""
    problems = held_out_problems(n_per_skill, tuple(s for s in SKILLS if s not in LONG))
    prompts = [tok.encode(prompt_text(tok, p, chat)) for p in problems]
    outs = trainer.greedy(prompts, max_new=7, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    correct: dict[str, list[bool]] = {s: [] for s in SKILLS if s not in LONG}
    for p, o in zip(problems, outs, strict=True):
        text = tok.decode([t for t in o if t != tok.eos_token_id])
        correct[p.skill].append(text.strip() == p.answer and bool(o) and o[-1] == tok.eos_token_id)
    acc = {s: float(np.mean(v)) for s, v in correct.items() if v}
    acc["arithmetic"] = float(np.mean([c for s in ARITHMETIC for c in correct[s]]))
    return acc


def save_orbax(ckpt_dir: Path, step: int, trainer: Trainer) -> None:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(ckpt_dir.absolute(), options=options) as mgr:
        mgr.save(step, args=ocp.args.StandardSave({"params": trainer.params, "opt_state": trainer.opt_state}))
        mgr.wait_until_finished()


def export(trainer: Trainer, tok_dir: Path, out_dir: Path, dtype: str) -> None:
    save_hf_checkpoint(trainer.model(trainer.params), out_dir, dtype=np.dtype(dtype), mtp=trainer.mtp(trainer.params))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out_dir / name)


def replay_args(args: argparse.Namespace, stop: int) -> list[str]:
    """The command line that trains this run again (recorded in training.json)."""
    replay = ["--steps", str(args.steps)] + (["--stop-at", str(stop)] if stop < args.steps else []) + [
              "--seed", str(args.seed), "--preset", args.preset,
              "--groups", str(args.groups), "--rows", str(args.rows),
              "--max-seqs", str(args.max_seqs), "--mix", args.mix, "--lr", str(args.lr),
              "--warmup", str(args.warmup), "--weight-decay", str(args.weight_decay),
              "--export-dtype", args.export_dtype] + (
                  ["--mtp-weight", str(args.mtp_weight), "--mtp-steps", str(args.mtp_steps)] if args.mtp_weight else [])
    if args.init_from:
        replay += ["--init-from", str(args.init_from)]
    if args.config_overrides:
        replay += ["--config-overrides", *args.config_overrides]
    return replay


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3600, help="the learning-rate schedule's length")
    ap.add_argument("--stop-at", type=int, default=0, metavar="STEP",
                    help="stop (checkpoint, export) at this step of the schedule (default: --steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/default-model", help="output directory (hf/ holds the export)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--config-overrides", nargs="*", default=DEFAULT_OVERRIDES, metavar="FIELD=VALUE",
                    help=f"ModelConfig fields over the preset (default: {' '.join(DEFAULT_OVERRIDES)})")
    ap.add_argument("--groups", type=int, default=10, help="packed groups per batch (one flat step each)")
    ap.add_argument("--rows", type=int, default=192, help="token rows per packed group (the long skills need 141)")
    ap.add_argument("--max-seqs", type=int, default=12, help="sequences per packed group at most")
    ap.add_argument("--mix", default=format_mix(SKILL_WEIGHTS),
                    help="skill weights of the training stream, SKILL=WEIGHT for every skill (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out check every N steps (0: at the end)")
    ap.add_argument("--eval-n", type=int, default=100, help="held-out problems per skill for the checks")
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--export-dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--mtp-weight", type=float, default=0.0,
                    help="train an MTP layer (speculative decoding's draft) jointly, its loss weighted so "
                         "(DeepSeek-V3: 0.3); 0: none")
    ap.add_argument("--init-from", metavar="DIR",
                    help="start the model from this checkpoint's weights (a later stage), and the MTP layer from its "
                         "MTP layer if it has one")
    ap.add_argument("--mtp-steps", type=int, default=1,
                    help="draft steps the MTP chain is trained for, unrolled (1: DeepSeek-V3's single step)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    tok_dir, hf_dir = out / "tokenizer", out / "hf"
    save_default_tokenizer(tok_dir)
    tok = Tokenizer(tok_dir)
    try:
        cfg = parse_overrides(args.config_overrides, PRESETS[args.preset])
        mix = parse_mix(args.mix)
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = cfg.with_(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if tok.vocab_size > cfg.vocab_size:
        print(f"error: the tokenizer has {tok.vocab_size} tokens, more than vocab_size {cfg.vocab_size}",
              file=sys.stderr)
        return 2
    stop = args.stop_at or args.steps
    if not 1 <= stop <= args.steps:
        print(f"error: --stop-at {args.stop_at} must be a step of the schedule, 1 to --steps {args.steps}",
              file=sys.stderr)
        return 2
    warmup = min(args.warmup, args.steps // 2)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=args.weight_decay))
    shape = PackShape(rows=args.rows, max_seqs=args.max_seqs)
    if args.mtp_weight < 0:
        print(f"error: --mtp-weight {args.mtp_weight} must be 0 (no MTP layer) or more", file=sys.stderr)
        return 2
    if args.mtp_steps < 1:
        print(f"error: --mtp-steps {args.mtp_steps} must be 1 or more", file=sys.stderr)
        return 2
    trainer = Trainer(cfg, args.seed, shape, optimizer, args.mtp_weight, args.mtp_steps)
    if args.init_from:
        try:
            mtp = None
            if args.mtp_weight > 0 and model_config(args.init_from).num_nextn_predict_layers:
                mtp = load_mtp(args.init_from, "float32")[1]  # its MTP layer goes on training too
            trainer.init_model_from(load_model(args.init_from, "float32")[1], mtp)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("model: %d params; %s", n_params, cfg)
    batches = train_batches(tok, args.seed, args.groups, shape, mix)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bar = tqdm(total=stop, desc="training", unit="step")
    with open(out / "train_log.jsonl", "w") as logf, bar:
        for step in range(1, stop + 1):
            batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
            trainer.params, trainer.opt_state, loss, gnorm = trainer.train_step(
                trainer.params, trainer.opt_state, batch)
            if step % 10 == 0 or step == stop:
                rec = {"step": step, "loss": float(loss), "grad_norm": float(gnorm), "lr": float(sched(step)),
                       "elapsed_s": round(time.perf_counter() - t0, 1)}
                if args.eval_every and step % args.eval_every == 0 and step < stop:
                    rec["held_out"] = quick_eval(trainer, tok, args.eval_n // 2)
                    log.info("step %d: %s", step, rec["held_out"])
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                bar.set_postfix(loss=f"{rec['loss']:.4f}")
            bar.update()
            if step % args.ckpt_every == 0 or step == stop:
                save_orbax(out / "checkpoints", step, trainer)
    train_s = time.perf_counter() - t0
    export(trainer, tok_dir, hf_dir, args.export_dtype)
    acc = evaluate_local(hf_dir, "dp=1", n=args.eval_n)  # the exported checkpoint, through the serving step
    replay = replay_args(args, stop)
    summary = {"args": replay, "train_seconds": round(train_s, 1), "params": n_params,
               "held_out_accuracy": acc, "eval_n_per_skill": args.eval_n}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.copy(out / "summary.json", hf_dir / "training.json")
    print(f"trained {stop} steps in {train_s:.0f} s; held-out greedy accuracy: "
          + ", ".join(f"{k} {v:.1%}" for k, v in acc.items()))
    print(f"exported to {hf_dir} (serve with --model-path {hf_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
