"""Train an EAGLE-3 head for a target on a text corpus and save it in the published layout
(jaxspec.model.eagle_train has the recipe). Prints the training and held-out loss, the held-out
top-1 agreement with the target per draft step, and at the end the acceptance the saved head
gets on HumanEval prompts through jaxspec.generate, beside the embedded 4M draft model's.

  python3 scripts/train_eagle.py --out checkpoints/hf/code-eagle-16m            # the embedded target
  python3 scripts/train_eagle.py --target FOLDER --corpus DIR [DIR ...] --out FOLDER

The default corpus is Python source like the embedded pair's (the standard library and the
installed packages); HumanEval is never in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import sysconfig
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import tokenizers

import jaxspec
from jaxspec.bench.humaneval import load_prompts
from jaxspec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model
from jaxspec.model.eagle import default_feature_layers, save_eagle_folder
from jaxspec.model.eagle_train import draft_vocabulary, init_params, target_pass, to_published, train_step, ttt_loss


def corpus_tokens(dirs: list[Path], tokenizer, max_files: int, eos: int, seed: int) -> np.ndarray:
    """Every *.py file under dirs (shuffled, at most max_files), tokenized, EOS between files."""
    files = sorted({f for d in dirs for f in Path(d).rglob("*.py") if f.is_file()})
    np.random.default_rng(seed).shuffle(files)
    texts = []
    for f in files[:max_files]:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 200 <= len(text) <= 200_000:
            texts.append(text)
    out = []
    for ids in encode_all(tokenizer, texts):
        out.extend(ids)
        out.append(eos)
    return np.asarray(out, np.int32)


def encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizers`' batch encode runs on every core; other tokenizers encode one text at a time."""
    backend = getattr(tokenizer, "backend", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return [e.ids for e in backend.encode_batch(texts)]
    return [tokenizer.encode(t) for t in texts]


def windows(tokens: np.ndarray, count: int, length: int, rng) -> np.ndarray:
    starts = rng.integers(0, len(tokens) - length, count)
    return np.stack([tokens[s : s + length] for s in starts])


def _fmt(values) -> str:
    return " ".join(f"{float(v):.3f}" for v in np.asarray(values))


def acceptance(prompts, target, draft, k: int, new_tokens: int) -> dict:
    outs = jaxspec.generate(prompts, target, draft, num_draft_tokens=k, max_new_tokens=new_tokens, max_batch_size=1,
                            warn_below_acceptance=0.0)
    steps = sum(o.stats.target_steps for o in outs)
    return {"tokens_per_step": sum(o.stats.new_tokens for o in outs) / steps,
            "acceptance_rate": sum(o.stats.accepted for o in outs) / max(1, sum(o.stats.drafted for o in outs))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model folder (default: the embedded code-target-16m)")
    p.add_argument("--out", required=True, help="folder to write the head to (published EAGLE-3 layout)")
    p.add_argument("--corpus", nargs="+", type=Path, help="directories of *.py files (default: stdlib + site-packages)")
    p.add_argument("--max-files", type=int, default=20_000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training (default 3)")
    p.add_argument("--feature-layers", type=int, nargs=3, metavar="K",
                   help="the target layers whose outputs the head reads (published eagle_aux_hidden_state_layer_ids; "
                        "default: EAGLE-3's, the inputs of layers 2, L/2, L-3)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="the head's vocabulary: the most frequent ids")
    p.add_argument("--intermediate-size", type=int, help="the head's MLP width (default: the target's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="float32", help="the target's compute dtype while training")
    p.add_argument("--max-minutes", type=float, help="stop training after this long (the schedule is cut short)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=20, help="HumanEval prompts for the final acceptance")
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    target = jaxspec.load(args.target or embedded_model(DEFAULT_TARGET), dtype=args.dtype)
    c = target.config
    dirs = args.corpus or sorted({Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib")})
    eos = c.eos_token_ids[0] if c.eos_token_ids else 0
    tokens = corpus_tokens(dirs, target.tokenizer, args.max_files, eos, args.seed)
    if len(tokens) < 4 * args.seq_len:
        raise SystemExit(f"corpus too small: {len(tokens)} tokens under {[str(d) for d in dirs]}")
    held = max(len(tokens) // 100, 2 * args.seq_len)
    train, val = tokens[:-held], tokens[-held:]
    draft_ids = draft_vocabulary(np.bincount(train, minlength=c.vocab_size), args.draft_vocab)
    print(f"corpus: {len(tokens):,} tokens from {[str(d) for d in dirs]} ({len(train):,} train, {len(val):,} held out); "
          f"draft vocabulary {len(draft_ids)} ids covering {np.isin(train, draft_ids).mean():.1%} of tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    for k in args.feature_layers or ():
        if not 0 <= k < c.num_layers:
            raise SystemExit(f"--feature-layers: {k} is not a layer of the target (0 .. {c.num_layers - 1})")
    layers = tuple(k + 1 for k in args.feature_layers) if args.feature_layers else default_feature_layers(c.num_layers)
    head_config = dataclasses.replace(c, num_layers=1, intermediate_size=args.intermediate_size or c.intermediate_size)
    params = init_params(target, draft_ids, head_config.intermediate_size, args.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), args.steps)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = optimizer.init(params)
    ids = jnp.asarray(draft_ids)
    rng = np.random.default_rng(args.seed)
    kw = dict(target_config=c, config=head_config, layers=layers, steps=args.ttt_steps, optimizer=optimizer)
    t1 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = jnp.asarray(windows(train, args.batch_size, args.seq_len, rng))
        params, opt_state, loss, agree = train_step(params, opt_state, target.weights, batch, ids, **kw)
        out_of_time = args.max_minutes and time.perf_counter() - t1 > 60 * args.max_minutes
        if step % args.log_every == 0 or step == args.steps or out_of_time:
            print(f"step {step}: loss {float(loss):.3f}, top-1 agreement per draft step "
                  f"{_fmt(agree)} ({time.perf_counter() - t1:.0f} s)", flush=True)
        if out_of_time:
            print(f"stopped at step {step} of {args.steps}: --max-minutes {args.max_minutes} reached", flush=True)
            break

    val_rng = np.random.default_rng(args.seed + 1)
    val_batch = jnp.asarray(windows(val, 2 * args.batch_size, args.seq_len, val_rng))
    feats, logp = target_pass(target.weights, c, val_batch, layers)
    val_loss, val_agree = ttt_loss(params, head_config, target.weights.embed, feats, val_batch, logp, ids,
                                   args.ttt_steps)
    print(f"held out: loss {float(val_loss):.3f}, top-1 agreement per draft step {_fmt(val_agree)}", flush=True)

    folder = save_eagle_folder(args.out, c, to_published(params, c, draft_ids),
                               feature_layers=layers if args.feature_layers else None)
    print(f"saved {folder} ({time.perf_counter() - t0:.0f} s in all)", flush=True)
    if args.eval_prompts:
        prompts = load_prompts(limit=args.eval_prompts)
        head = jaxspec.load(folder, dtype=args.dtype)
        draft = jaxspec.load(embedded_model(DEFAULT_DRAFT), dtype=args.dtype)
        for name, d in (("eagle head", head), ("4M draft model", draft)):
            r = acceptance(prompts, target, d, args.num_draft_tokens, args.eval_new_tokens)
            print(f"HumanEval {args.eval_prompts} prompts, K={args.num_draft_tokens}, greedy: {name}: "
                  f"{r['tokens_per_step']:.2f} tokens per target step, acceptance {r['acceptance_rate']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
