"""Threads or a worker process for the rollouter? Measure the two sides' throughput alone and together.

    .venv/bin/python benchmarks/rl_threads_vs_process.py [--seconds 8] [--json out.json]

Rollout work: waves of 32 prompts x 8 samples of the built-in task (KV-cached sampling).
Train work: GRPO updates on a fixed batch of 32 x 8 (forward, backward, Adam step).
Each is run alone, then both at once as two threads of one process (torch intra-op
threads 1 and 2 in each) and as two processes (1 intra-op thread each), in rounds;
printed: medians of waves/s and updates/s, and the combined share -- each side's speed
over its speed alone (1 thread), summed: 2.0 is perfect overlap, 1.0 none. On a machine
shared with other work the numbers move from round to round: the rounds are printed too.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import threading
import time

import torch

from stateshift.rl import algo
from stateshift.train.rollout import KVRollouter, Wave
from stateshift.train.sampler import BuiltinLM, Sampling, sequence_logprobs
from stateshift.train.tasks.addition import AdditionTask
from stateshift.train.tasks.gpt import GPTConfig, build_gpt
from stateshift.train.trainer import Batch

TASK = AdditionTask()
SAMPLING = Sampling(temperature=1.0, max_new_tokens=5, stop_token=TASK.stop_token, pad_token=TASK.pad_token)


def _wave(rng: random.Random) -> Wave:
    items = [TASK.sample(rng) for _ in range(32)]
    return Wave.start(list(range(32)), items, [TASK.prompt(i) for i in items], 8, SAMPLING)


def rollout_work(seconds: float, threads: int | None = None) -> float:
    """Waves per second."""
    if threads:
        torch.set_num_threads(threads)
    r = KVRollouter(BuiltinLM(build_gpt(GPTConfig(max_len=13), seed=0)), SAMPLING, seed=0)
    rng = random.Random(0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        wave = _wave(rng)
        r.generate(wave)
        wave.groups(TASK.score)
        n += 1
    return n / (time.perf_counter() - t0)


def train_work(seconds: float, threads: int | None = None) -> float:
    """GRPO updates per second."""
    if threads:
        torch.set_num_threads(threads)
    lm = BuiltinLM(build_gpt(GPTConfig(max_len=13), seed=0))
    wave = _wave(random.Random(1))
    KVRollouter(lm, SAMPLING, seed=1).generate(wave)
    batch = Batch.of(wave.groups(TASK.score), TASK.pad_token)
    opt = torch.optim.Adam(lm.module.parameters(), lr=1e-4)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        with torch.no_grad():
            l_p = sequence_logprobs(lm, batch.prompt_ids, batch.prompt_mask, batch.tokens)[0]
        l_t = sequence_logprobs(lm, batch.prompt_ids, batch.prompt_mask, batch.tokens)[0]
        adv = algo.grpo_advantages(batch.rewards).reshape(-1)
        loss, _ = algo.ppo_loss(l_t, l_p, adv, torch.ones_like(l_t), batch.mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        n += 1
    return n / (time.perf_counter() - t0)


def _both_threads(seconds: float, threads: int) -> tuple[float, float]:
    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    t = threading.Thread(target=lambda: out.__setitem__("rollout", rollout_work(seconds, threads)))
    t.start()
    out["train"] = train_work(seconds, threads)
    t.join()
    return out["rollout"], out["train"]


def _both_processes(seconds: float) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        r = pool.apply_async(rollout_work, (seconds, 1))
        t = pool.apply_async(train_work, (seconds, 1))
        return r.get(), t.get()


def _round(s: float) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for threads in (1, 2):
        rows[f"alone, {threads} intra-op thread(s)"] = {
            "rollout": rollout_work(s, threads),
            "train": train_work(s, threads),
        }
    for threads in (1, 2):
        r, t = _both_threads(s, threads)
        rows[f"two threads, {threads} intra-op thread(s) each"] = {"rollout": r, "train": t}
    r, t = _both_processes(s)
    rows["two processes, 1 intra-op thread each"] = {"rollout": r, "train": t}
    alone = rows["alone, 1 intra-op thread(s)"]
    for row in rows.values():  # 2.0 = both sides as fast as alone; 1.0 = no overlap at all
        row["combined_share"] = row["rollout"] / alone["rollout"] + row["train"] / alone["train"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all five measurements (medians reported)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rounds = [_round(args.seconds) for _ in range(args.rounds)]
    medians = {name: {k: statistics.median(r[name][k] for r in rounds) for k in rounds[0][name]} for name in rounds[0]}
    for name, row in medians.items():
        spread = [r[name]["combined_share"] for r in rounds]
        print(
            f"{name:44s} rollout {row['rollout']:6.2f} waves/s  train {row['train']:6.2f} updates/s  "
            f"combined share {row['combined_share']:4.2f} (rounds: {', '.join(f'{x:.2f}' for x in spread)})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": args.seconds, "rounds": rounds, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
