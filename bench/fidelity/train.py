#!/usr/bin/env python3
"""Trains the fidelity model (model.py) on bench/fidelity/data/train.bin mixed with passkey and multi-key tasks.

    python3 bench/fidelity/train.py --time-budget 360 --out bench/fidelity/checkpoint.npz   # the GPU run
    /usr/bin/python3 bench/fidelity/train.py --tiny --out /tmp/tiny.npz                       # CPU smoke run

Seeded (torch, numpy, sample order). The learning-rate schedule (linear warm-up, cosine decay) runs on the fraction
of the wall-clock budget spent, so a faster or slower card trains more or fewer steps: `--steps N` fixes the step
count instead (the log records the steps a run took, so `--steps` reproduces it). The context is `--seq-len` (4096)
for the first `--long-after` of the run, then twice that with half the batch (8192), so the model has seen 8K
positions. On CUDA: bf16 autocast, TF32, fused AdamW; `--compile` adds torch.compile (eager if it fails).
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
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--answer-weight", type=float, default=1.0)
    p.add_argument("--task-mix", default="0.5,0.25,0.25", help="text,passkey,multikey probabilities")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (off by default: its compile time, twice with the 8K phase, costs "
                        "about what it saves in a 6-minute run)")
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
    config = model_lib.TINY_CONFIG if args.tiny else model_lib.DEFAULT_CONFIG
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

    def log_heldout(step, elapsed):
        if eval_windows is None:
            return None
        loss = heldout_loss(model, eval_windows, device, autocast)
        entry = {"step": step, "elapsed_s": round(elapsed, 2), "heldout_loss": loss,
                 "heldout_bits_per_byte": loss / math.log(2)}
        log.write(json.dumps(entry) + "\n")
        log.flush()
        print(f"train: step={step} heldout bits_per_byte={loss / math.log(2):.4f}", flush=True)
        return loss

    start = time.time()
    last_eval = start
    step, tokens_seen, progress = 0, 0, 0.0
    while True:
        progress = step / args.steps if args.steps else (time.time() - start) / args.time_budget
        if progress >= 1.0:
            break
        long_phase = progress >= args.long_after
        seq = args.seq_len * (2 if long_phase else 1)
        bsz = max(1, args.batch // (2 if long_phase else 1))
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
               "long_after": args.long_after, "answer_weight": args.answer_weight, "compiled": compiled,
               "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "torch": torch.__version__, "final_loss_lm": float(lm), "data_bytes": int(len(text)),
               "heldout_bits_per_byte": final_heldout / math.log(2) if final_heldout is not None else None}
    log.write(json.dumps({"summary": summary}) + "\n")
    log.close()
    model_lib.save_checkpoint(model, args.out, extra=summary)
    print(f"train: done, {step} steps, {tokens_seen} tokens in {elapsed:.0f} s; wrote {args.out} "
          f"({os.path.getsize(args.out)} bytes) and {log_path}", flush=True)


if __name__ == "__main__":
    main()
