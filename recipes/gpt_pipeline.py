"""A GPT-style character LM trained with pipeline parallelism (DP x PP) that survives a worker
killed mid-run.

    python recipes/gpt_pipeline.py --workers 8 --stages 4 --kill-worker 2 --at-step 6 --policy replan
    python -m chameleon_ft.cli.launch --nproc-per-node 8 recipes/gpt_pipeline.py --out DIR   # no kill

Model (built from flags, no download): ``nn.Sequential`` of blocks -- an embedding block
(token + position embeddings), ``--layers`` pre-LN transformer blocks (causal self-attention with
``scaled_dot_product_attention(is_causal=True)``, GELU MLP), and a head block (LayerNorm +
Linear to the vocabulary).  ``ElasticTrainer(stages=--stages)`` spreads them over pipelines of
``--stages`` workers (8 workers, 4 stages: 2 pipelines); each worker keeps only its stage's.
Data: the characters of ``recipes/data/sentiment_train.jsonl`` (vocabulary of the corpus), in
blocks of 32 tokens; an item is ``(tokens[:-1], tokens[1:])``; loss: cross entropy over all
positions.

Started directly (``python recipes/gpt_pipeline.py``), the script is its own launcher side: it
starts ``chameleon-ft run`` through ``LocalJob``, sends SIGKILL to ``--kill-worker``'s PID from
outside once ``--at-step`` steps are committed, relays the workers' ``recipe:`` lines, and
completes ``<out>/result.json`` with what the event log says (every decision, the bytes the
migration moved against the prediction, the MTTR).

Limits: CPU only, a toy corpus and model; no evaluation pass (no worker holds the whole model,
so the printed losses are training losses: the global mean of each committed step); with
``--policy adaptive`` the engine may choose between reroute and replan only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BLOCK = 32
POLICIES = {"adaptive": "reroute,replan", "reroute": "reroute", "replan": "replan"}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=8, help="worker processes (launcher side, default 8)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-samples", type=int, default=None, help="use the first N blocks of 32 tokens")
    p.add_argument("--policy", choices=sorted(POLICIES), default="adaptive")
    p.add_argument("--kill-worker", type=int, default=None, help="SIGKILL this worker from outside ...")
    p.add_argument("--at-step", type=int, default=6, help="... once this many steps are committed")
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=600.0, help="launcher side: give up after (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output dir (default: a new temp dir; under chameleon-ft run, its --run-dir)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ the model
def build_blocks(vocab: int, a: argparse.Namespace):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, a.hidden), nn.Embedding(BLOCK, a.hidden)

        def forward(self, x):
            return self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(a.hidden), nn.LayerNorm(a.hidden)
            self.qkv, self.proj = nn.Linear(a.hidden, 3 * a.hidden), nn.Linear(a.hidden, a.hidden)
            self.mlp = nn.Sequential(nn.Linear(a.hidden, 4 * a.hidden), nn.GELU(), nn.Linear(4 * a.hidden, a.hidden))

        def forward(self, h):
            b, t, c = h.shape
            q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, a.heads, c // a.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.proj(att.transpose(1, 2).reshape(b, t, c))
            return h + self.mlp(self.ln2(h))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.out = nn.LayerNorm(a.hidden), nn.Linear(a.hidden, vocab)

        def forward(self, h):
            return self.out(self.ln(h))

    torch.manual_seed(a.seed)  # every worker builds the same blocks
    return nn.Sequential(Embed(), *[Transformer() for _ in range(a.layers)], Head())


def dataset(max_samples=None):
    """(x, y) pairs of the corpus in blocks of ``BLOCK`` tokens, and the vocabulary size."""
    import torch

    sys.path.insert(0, str(HERE))
    from causal_lm import load_text

    train, evl = load_text(str(HERE / "data"), "train"), load_text(str(HERE / "data"), "eval")
    vocab = sorted(set(train) | set(evl))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in train])
    blocks = [ids[i:i + BLOCK] for i in range(0, len(ids) - BLOCK + 1, BLOCK)][:max_samples]
    return [(b[:-1], b[1:]) for b in blocks], len(vocab)


# ------------------------------------------------------------------------------ a worker
def worker(a: argparse.Namespace) -> None:
    import torch
    from torch.nn import functional as F

    from chameleon_ft import ElasticConfig, ElasticTrainer

    torch.set_num_threads(1)
    data, vocab = dataset(a.max_samples)
    blocks = build_blocks(vocab, a)
    opt = torch.optim.AdamW(blocks.parameters(), lr=a.lr, weight_decay=0.01)
    per_epoch: list[list[float]] = [[]]
    seen = {"recoveries": 0}

    def lead(ctx) -> bool:
        return ctx.worker_id == min(ctx.members)

    def on_step(ctx) -> None:
        if ctx.recoveries != seen["recoveries"]:
            seen["recoveries"] = ctx.recoveries
            rec = ctx.last_recovery or {}
            if lead(ctx):
                for d in ctx.last_decisions:
                    cands = ", ".join(f"{c['policy']} {c['step_time_s']:.3f} s/step" if c.get("feasible")
                                      and c.get("step_time_s") is not None else f"{c['policy']} ruled out"
                                      for c in d.get("candidates", []))
                    print(f"recipe: decision {d.get('chosen')} ({cands})", flush=True)
                mttr = rec.get("mttr", {})
                print(f"recipe: recovered at step {rec.get('step')}: members {list(ctx.members)}, MTTR "
                      f"{mttr.get('total', float('nan')) * 1000:.0f} ms", flush=True)
        per_epoch[-1].append(ctx.last_loss)
        if len(per_epoch) <= ctx.epoch:
            losses = per_epoch[-1]
            if lead(ctx):
                print(f"recipe: epoch {len(per_epoch) - 1} train loss {sum(losses) / len(losses):.4f} "
                      f"(step {ctx.step}, {len(ctx.members)} workers)", flush=True)
            per_epoch.append([])

    trainer = ElasticTrainer(
        blocks, opt, data, lambda logits, batch: F.cross_entropy(logits.reshape(-1, vocab), batch[1].reshape(-1)),
        a.global_batch, a.micro_batch, seed=a.seed, stages=a.stages, on_step=on_step,
        config=ElasticConfig(allowed_policies=frozenset(POLICIES[a.policy].split(","))))
    result = trainer.fit(epochs=a.epochs)
    ctx = trainer.ctx
    out = a.out or os.environ.get("CHAMELEON_FT_RUN_DIR") or "."
    # Each worker: the squared norms of the blocks it holds (the launcher side merges them).
    with open(os.path.join(out, f"blocks_{ctx.worker_id}.json"), "w") as f:
        json.dump({str(b): sum(float(p.detach().double().pow(2).sum()) for p in ctx.blocks[b].parameters())
                   for b in sorted(ctx.held)}, f)
    if lead(ctx):
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"final_loss": ctx.last_loss, "steps": result["step"], "members": result["members"],
                       "epoch_losses": [sum(x) / len(x) for x in per_epoch if x],
                       "recoveries": ctx.recoveries, "last_decisions": ctx.last_decisions,
                       "parameters": sum(b.numel() for blk in ctx.blocks for b in blk.parameters())}, f)
        print(f"recipe: done, {result['step']} steps, final loss {ctx.last_loss:.6f}", flush=True)


# ------------------------------------------------------------------------------ launcher side
def summarize(out: Path) -> dict:
    """Complete ``result.json`` with the event log: decisions, migration, MTTR, block norms."""
    sys.path.insert(0, str(ROOT))
    from chameleon_ft.cli.report import wall_throughput
    from chameleon_ft.runtime.eventlog import read_events

    events = read_events(out / "events.jsonl")
    result = json.loads((out / "result.json").read_text())
    decisions, keys = [], set()
    for e in events:
        if e["event"] == "decision":
            key = json.dumps(e["decision"].get("event", {}), sort_keys=True) + str(e.get("step"))
            if key not in keys:
                keys.add(key)
                decisions.append(e["decision"])
    moved = [e for e in events if e["event"] == "migration" and e.get("phase") == "end" and e["step"] > 0]
    starts = [e for e in events if e["event"] == "migration" and e.get("phase") == "start" and e["step"] > 0]
    norms: dict[str, float] = {}
    for p in out.glob("blocks_*.json"):
        norms.update(json.loads(p.read_text()))  # replicas are equal: any copy
    result.update(
        decisions=decisions,
        migration={"bytes": sum(e["bytes"] for e in moved), "transfers": sum(e["transfers"] for e in moved),
                   "predicted_bytes": sum(e.get("predicted_bytes") or 0 for e in starts),
                   "seconds": max((e["seconds"] for e in moved), default=0.0)},
        mttr=[e.get("mttr") for e in events if e["event"] == "recovery"],
        block_norms={b: math.sqrt(norms[b]) for b in sorted(norms, key=int)},
        **{k: v for k, v in wall_throughput(events).items() if k.startswith("throughput_")})
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def launch(a: argparse.Namespace) -> int:
    import tempfile

    sys.path.insert(0, str(ROOT))
    from chameleon_ft.cli.localjob import LocalJob

    out = Path(a.out or tempfile.mkdtemp(prefix="chameleon-gpt-pipeline-")).resolve()
    argv = [x for x in sys.argv[1:]]
    if "--out" not in argv:
        argv += ["--out", str(out)]
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = LocalJob(out, __file__, argv, nproc=a.workers, hang_timeout=a.hang_timeout, env=env)
    print(f"recipe: chameleon-ft run, {a.workers} workers, {a.stages} stages, policy {a.policy}, "
          f"kill {'none' if a.kill_worker is None else f'worker {a.kill_worker} after step {a.at_step}'}, out {out}",
          flush=True)
    log, pos = out / "launcher0.out", [0]

    def relay(*_):
        if log.exists():
            with open(log, "rb") as f:
                f.seek(pos[0])
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            pos[0] += end
            for line in chunk[:end].decode(errors="replace").splitlines():
                if line.startswith("recipe:") or "Error" in line:
                    print(line, flush=True)

    try:
        code = job.drive(a.kill_worker, a.at_step, a.timeout, on_tick=relay,
                         on_kill=lambda w, pid, done: print(f"recipe: SIGKILL worker {w} (pid {pid}) after "
                                                            f"step {done}", flush=True))
    finally:
        job.cleanup()
    relay()
    if code != 0:
        print(f"recipe: the job ended with {code}; see {log}", flush=True)
        return 1 if code is None else code
    r = summarize(out)
    from chameleon_ft.cli.report import describe_layout

    for d in r["decisions"]:
        plan = next((c.get("plan") for c in d["candidates"] if c["policy"] == d["chosen"]), None)
        print(f"recipe: engine chose {d['chosen']} for {d['event'].get('kind')} of {d['event'].get('devices')}; "
              f"layout {describe_layout(plan)}", flush=True)
    m = r["migration"]
    print(f"recipe: migration moved {m['bytes']} bytes (predicted {m['predicted_bytes']}) in {m['transfers']} "
          f"transfers; final loss {r['final_loss']:.6f}; result {out / 'result.json'}", flush=True)
    return 0


def main() -> None:
    a = parse()
    if os.environ.get("CHAMELEON_FT_WORKER_ID"):
        from chameleon_ft import elastic_main
        elastic_main(lambda: worker(a))
    else:
        sys.exit(launch(a))


if __name__ == "__main__":
    main()
