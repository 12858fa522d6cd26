#!/usr/bin/env python3
"""Trains the fidelity model (model.py) on bench/fidelity/data/train.bin mixed with passkey and multi-key tasks.

    python3 bench/fidelity/train.py --time-budget 360 --out bench/fidelity/checkpoint.npz   # the GPU run
    /usr/bin/python3 bench/fidelity/train.py --tiny --out /tmp/tiny.npz                       # CPU smoke run

Seeded (torch, numpy, sample order). The learning-rate schedule (linear warm-up, cosine decay) runs on the fraction
of the wall-clock budget spent, so a faster or slower card trains more or fewer steps: `--steps N` fixes the step
count instead (the log records the steps a run took, so `--steps` reproduces it). Length curriculum on the same
schedule: the context starts at `--curriculum-start` (512) and doubles, at the same bytes per step, up to `--seq-len`
(4096): its contexts share the first `--curriculum-until` (40 %) of the run equally (512, 1024, 2048 for 10 %
each, 4096 from 30 %); twice that with half the batch (8192) after `--long-after`
(75 %), so the model has seen 8K positions. Retrieval samples are easier to find in short contexts (fewer distractor
positions), which lets the retrieval heads form before the context grows (docs/fidelity.md, Training).
`--curriculum-start 0` trains at `--seq-len` from the first step (the recipe of the committed checkpoint). At every
held-out evaluation, passkey and multi-key accuracy (every answer byte the argmax, teacher-forced) on fixed samples
of held-out text at `--seq-len` is logged too; `--model '{"d_model": 128}'` overrides the model config (small-scale
experiments). On CUDA: bf16 autocast, TF32, fused AdamW; `--compile` adds torch.compile (eager if it fails).
Loss = next-byte cross-entropy over all bytes + `--answer-weight` x the mean over the tasks' answer bytes.
Writes the checkpoint (fp16 .npz, config and training summary inside) and a JSON-lines log next to it (`--log`).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model as model_lib  # noqa: E402
import tasks  # noqa: E402

WARMUP_FRACTION = 0.03
MIN_LR_FRACTION = 0.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(HERE, "data", "train.bin"))
    p.add_argument("--out", default=os.path.join(HERE, "checkpoint.npz"))
    p.add_argument("--log", default=None, help="JSON-lines log (default: <out without .npz>.log.jsonl)")
    p.add_argument("--time-budget", type=float, default=360.0, help="seconds of training (wall clock)")
    p.add_argument("--steps", type=int, default=0, help="fixed number of steps instead of the time budget")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--long-after", type=float, default=0.75, help="fraction of the run after which seq doubles")
    p.add_argument("--curriculum-start", type=int, default=512,
                   help="first context of the length curriculum (doubling up to --seq-len, same bytes per step); "
                        "0: --seq-len from the start (the recipe of the committed checkpoint)")
    p.add_argument("--curriculum-until", type=float, default=0.4,
                   help="fraction of the run the curriculum's contexts share equally (--seq-len in the last share)")
    p.add_argument("--model", default="", help="JSON overrides of the model config, e.g. '{\"d_model\": 128}'")
    p.add_argument("--retrieval-samples", type=int, default=32,
                   help="passkey and multi-key samples (each, random depths) scored at every held-out evaluation")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--answer-weight", type=float, default=1.0)
    p.add_argument("--task-mix", default="0.5,0.25,0.25", help="text,passkey,multikey probabilities")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (off by default: its compile time, once per context of the "
                        "schedule (five with the curriculum), cost about what it saved in a 6-minute run without one)")
    p.add_argument("--tiny", action="store_true", help="tiny model, short context, a few steps on the CPU")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--heldout", default=os.path.join(HERE, "data", "heldout.bin"))
    p.add_argument("--eval-every-s", type=float, default=30.0, help="held-out loss every S seconds (and at the end)")
    p.add_argument("--eval-windows", type=int, default=4)
    return p.parse_args(argv)


def lr_at(progress, base):
    if progress < WARMUP_FRACTION:
        return base * max(progress / WARMUP_FRACTION, 0.01)
    t = (progress - WARMUP_FRACTION) / (1 - WARMUP_FRACTION)
    return base * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def context_at(progress, args):
    """(context, batch) of the step at `progress`: the curriculum's contexts (--curriculum-start doubled up to
    --seq-len) in equal shares of the first --curriculum-until of the run, then --seq-len, then twice it with half
    the batch after --long-after. Shorter contexts keep the bytes per step (batch x context) of --seq-len."""
    if progress >= args.long_after:
        return args.seq_len * 2, max(1, args.batch // 2)
    seq = args.seq_len
    if 0 < args.curriculum_start < args.seq_len and progress < args.curriculum_until:
        doublings = int(round(math.log2(args.seq_len / args.curriculum_start)))
        stage = int(progress / args.curriculum_until * (doublings + 1))
        seq = min(args.seq_len, args.curriculum_start << stage)
    return seq, args.batch * (args.seq_len // seq)


def retrieval_scores(model, sets, device, autocast):
    """{task: {"accuracy", "answer_loss"}}: the fraction of samples whose every answer byte is the argmax
    (teacher-forced, as harness.py scores it) and the mean answer-byte loss (nats)."""
    model.eval()
    out = {}
    with torch.no_grad(), autocast():
        for task, (tokens_np, masks_np) in sets.items():
            correct, losses = [], []
            for row, mask in zip(tokens_np, masks_np):
                tokens = torch.from_numpy(row[None].astype(np.int64)).to(device)
                logits = model(tokens[:, :-1]).float()[0]
                answer = torch.from_numpy(mask[1:]).to(device)
                targets = tokens[0, 1:]
                correct.append(bool((logits.argmax(-1)[answer] == targets[answer]).all()))
                losses.append(float(F.cross_entropy(logits[answer], targets[answer])))
            out[task] = {"accuracy": float(np.mean(correct)), "answer_loss": float(np.mean(losses))}
    model.train()
    return out


def loss_fn(model, tokens, masks, answer_weight, rope):
    logits = model(tokens[:, :-1], rope=rope)
    targets = tokens[:, 1:]
    per_byte = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    lm = per_byte.mean()
    answer = masks[:, 1:].reshape(-1).float()
    answer_loss = (per_byte * answer).sum() / answer.sum().clamp(min=1.0)
    return lm + answer_weight * answer_loss, lm.detach(), answer_loss.detach()


def heldout_loss(model, windows, device, autocast):
    """Mean next-byte loss (nats) of the eager model on fixed held-out windows (int64 [N, S+1])."""
    model.eval()
    total = 0.0
    with torch.no_grad(), autocast():
        for row in windows:
            tokens = torch.from_numpy(row[None]).to(device)
            logits = model(tokens[:, :-1])
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))
    model.train()
    return total / len(windows)


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        args.seq_len, args.batch = min(args.seq_len, 256), min(args.batch, 4)
        if not args.steps:
            args.steps = 30
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    text = tasks.load_bytes(args.data)
    mix = [float(x) for x in args.task_mix.split(",")]
    config = dict(model_lib.TINY_CONFIG if args.tiny else model_lib.DEFAULT_CONFIG)
    config.update(json.loads(args.model) if args.model else {})
    model = model_lib.ByteLM(config).to(device)
    print(f"train: {model_lib.parameter_count(model)} parameters, device {device}, "
          f"torch {torch.__version__}, {len(text)} text bytes", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:  # the fused CUDA step (torch >= 2.0)
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step_fn = model
    compiled = False
    if device == "cuda" and args.compile and hasattr(torch, "compile"):
        try:
            step_fn = torch.compile(model)
            compiled = True
        except Exception as exc:  # an unusable compiler only costs speed
            print(f"train: torch.compile unavailable ({exc}); eager", flush=True)
    log_path = args.log or os.path.splitext(args.out)[0] + ".log.jsonl"
    log = open(log_path, "w")

    def autocast():  # a fresh context manager per use
        return (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda"
                else torch.autocast("cpu", enabled=False))

    heldout = tasks.load_bytes(args.heldout) if os.path.exists(args.heldout) else None
    eval_windows = None
    if heldout is not None:
        stride = (len(heldout) - args.seq_len - 1) // args.eval_windows
        eval_windows = np.stack([heldout[i * stride:i * stride + args.seq_len + 1]
                                 for i in range(args.eval_windows)]).astype(np.int64)

    retrieval_sets = {}
    if heldout is not None and args.retrieval_samples > 0:  # fixed samples of held-out text at --seq-len
        eval_rng = np.random.default_rng(args.seed + 1)
        for task, maker in (("passkey", tasks.passkey_sample), ("multikey", tasks.multikey_sample)):
            rows = [maker(eval_rng, heldout, args.seq_len + 1) for _ in range(args.retrieval_samples)]
            retrieval_sets[task] = (np.stack([np.frombuffer(r, np.uint8) for r, _ in rows]),
                                    np.stack([m for _, m in rows]))
    last_retrieval = {}

    def log_heldout(step, elapsed):
        if eval_windows is None:
            return None
        loss = heldout_loss(model, eval_windows, device, autocast)
        entry = {"step": step, "elapsed_s": round(elapsed, 2), "heldout_loss": loss,
                 "heldout_bits_per_byte": loss / math.log(2)}
        if retrieval_sets:
            last_retrieval.clear()
            last_retrieval.update(retrieval_scores(model, retrieval_sets, device, autocast))
            entry["retrieval"] = dict(last_retrieval)
        log.write(json.dumps(entry) + "\n")
        log.flush()
        print(f"train: step={step} heldout bits_per_byte={loss / math.log(2):.4f} " + " ".join(
            f"{t}_acc={r['accuracy']:.3f} {t}_answer_loss={r['answer_loss']:.3f}" for t, r in last_retrieval.items()),
            flush=True)
        return loss

    start = time.time()
    last_eval = start
    step, tokens_seen, progress = 0, 0, 0.0
    while True:
        progress = step / args.steps if args.steps else (time.time() - start) / args.time_budget
        if progress >= 1.0:
            break
        seq, bsz = context_at(progress, args)
        lr = lr_at(progress, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        batch_tokens, batch_masks = tasks.batch(rng, text, bsz, seq + 1, mix)
        tokens = torch.from_numpy(batch_tokens.astype(np.int64)).to(device, non_blocking=True)
        masks = torch.from_numpy(batch_masks).to(device, non_blocking=True)
        rope = model.rope(seq, device)
        try:
            with autocast():
                loss, lm, answer = loss_fn(step_fn, tokens, masks, args.answer_weight, rope)
        except Exception as exc:
            if not compiled:
                raise
            print(f"train: compiled model failed ({type(exc).__name__}: {exc}); falling back to eager", flush=True)
            step_fn, compiled = model, False
            with autocast():
                loss, lm, answer = loss_fn(step_fn, tokens, masks, args.answer_weight, rope)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += bsz * seq
        if time.time() - last_eval >= args.eval_every_s:
            log_heldout(step, time.time() - start)
            last_eval = time.time()
        if step % args.log_every == 0 or step == 1:
            entry = {"step": step, "elapsed_s": round(time.time() - start, 2), "lr": lr, "seq": seq,
                     "loss_lm": float(lm), "bits_per_byte": float(lm) / math.log(2), "loss_answer": float(answer),
                     "tokens": tokens_seen}
            log.write(json.dumps(entry) + "\n")
            log.flush()
            print("train: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in entry.items()), flush=True)
    elapsed = time.time() - start
    final_heldout = log_heldout(step, elapsed)
    summary = {"steps": step, "tokens": tokens_seen, "elapsed_s": round(elapsed, 1), "seed": args.seed,
               "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr, "task_mix": mix,
               "long_after": args.long_after, "curriculum_start": args.curriculum_start,
               "curriculum_until": args.curriculum_until, "model_config": config, "answer_weight": args.answer_weight,
               "compiled": compiled,
               "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "torch": torch.__version__, "final_loss_lm": float(lm), "data_bytes": int(len(text)),
               "heldout_bits_per_byte": final_heldout / math.log(2) if final_heldout is not None else None,
               "retrieval_at_seq_len": dict(last_retrieval)}
    log.write(json.dumps({"summary": summary}) + "\n")
    log.close()
    model_lib.save_checkpoint(model, args.out, extra=summary)
    print(f"train: done, {step} steps, {tokens_seen} tokens in {elapsed:.0f} s; wrote {args.out} "
          f"({os.path.getsize(args.out)} bytes) and {log_path}", flush=True)


if __name__ == "__main__":
    main()
