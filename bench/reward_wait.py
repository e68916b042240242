"""CPU benchmark: the reward wait after generation on GSM8K-like rollouts (issue 37, item 3);
prints three tables, asserts no time.

Rows: ``--rows`` responses to GSM8K problems (``--data``, default the package's sample), of the
kinds a 135M model writes at temperature 1 (:func:`model_like`): a ``####`` line right or wrong,
"The answer is N", a short ramble that ends without an answer, a 256-token ramble cut off
mid-word with numbers and arithmetic and no answer (``truncated``, ~55% of the rows as on the
H100 run), LaTeX fragments, emoji and other scripts; or real responses (``--responses``, a JSON
list of ``{"answer": GSM8K answer column, "response": text, "truncated": bool}``).

1. **The verifier per row, by kind** (``math_reward`` in one fresh process per mode, rows in a
   shuffled order): ``cold`` as a reward-pool process before this change scored them (imported,
   nothing else), ``warm`` after :func:`mcore_rl.rewards.math.warm_up` (what each pool process
   now runs when it starts). Median, 90th percentile and max milliseconds per kind; a code path
   of math-verify or SymPy used for the first time costs its first row 20-400 ms.
   Then **one pool process over a run's first steps**: ``--process-rows`` rows a step (the
   H100 run's 256 rows over 14 processes: 18), ``--process-steps`` steps, fresh rows each, in a
   fresh process per seed (3); the slowest row of each step (cold / warm), the floor of that
   step's wait when the row is among the last.
2. **The pool's round trip** (:class:`~mcore_rl.rewards.pool.RewardScorer`, ``--workers``
   processes): wall milliseconds per row of a trivial reward (``exact``: the pool's own cost per
   row) and of the math verifier over the rows, against its busy time, and the controller's own
   CPU milliseconds for them (its threads: feeding the pool, the executor's; not the pool's
   processes), which the controller's other work of the step waits for.
3. **The wait** (``timing/reward_s``'s part): per step of ``--steps``, fresh rows each, the
   rollout scored while decoding as :class:`~mcore_rl.rewards.pool.StreamingRewards` gets it
   (the rows that end handed over through a decode of ``--decode-s`` seconds in the order of
   their lengths, the truncated ones at its end; ``early``) and after generation (``after``,
   ``RewardScorer.submit``), each with the pool's processes not warmed up (``warm_workers=False``,
   as before) and warmed up (the default). The wait is the seconds from the last row handed over
   (or the submit) to the rewards.

Example::

    python bench/reward_wait.py --rows 256 --workers 2 --steps 5
    python bench/reward_wait.py --tables 3 --rows 36 --steps 8   # 18 rows a process a step
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.data.example import Example  # noqa: E402

KINDS = ("hash_right", "hash_wrong", "answer_is", "ended_ramble", "truncated", "latex",
         "unicode")
FILLER = ("so", "then", "we", "have", "the", "total", "is", "and", "each", "of", "them", "but",
          "if", "she", "he", "buys", "sells", "more", "less", "per", "day", "week", "times",
          "half", "left", "dollars", "minutes", "first", "next", "answer", "find", "need")
ODD = ("\U0001f3ad", "\U0001f3af", "\u2248", "\u2234", "\u221a", "\u00bd", "\u00d7", "\u2264",
       "CLIPS", "Batangam", "Abusive", "\u00e9t\u00e9", "\u4e09")


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        return str(rng.randint(0, 500))
    if kind < 0.75:
        return f"{rng.randint(0, 99)}.{rng.randint(1, 99)}"
    if kind < 0.85:
        return f"{rng.randint(1, 99)}%"
    if kind < 0.95:
        return f"{rng.randint(1, 30)}/{rng.randint(2, 40)}"
    return f"{rng.randint(1, 9)},{rng.randint(100, 999)}"


def _ramble(rng: random.Random, words: Sequence[str], chars: int, odd: float = 0.0) -> str:
    """Sentences of the problem's words, filler, numbers and arithmetic, ``chars`` long."""
    out: List[str] = []
    size = 0
    while size < chars:
        r = rng.random()
        if r < 0.15:
            a, b = rng.randint(1, 60), rng.randint(1, 12)
            piece = f"{a} {rng.choice('*+-/x')} {b} = {rng.choice([a * b, a + b, a - b, a // b])}"
        elif r < 0.3:
            piece = _number(rng)
        elif r < 0.3 + odd:
            piece = rng.choice(ODD)
        else:
            piece = rng.choice(words) if rng.random() < 0.5 else rng.choice(FILLER)
        if rng.random() < 0.08:
            piece += rng.choice([".\n", ". ", ",", ":\n", "?"])
        out.append(piece)
        size += len(piece) + 1
    return " ".join(out)


def model_like(example: Example, kind: str, rng: random.Random) -> Tuple[str, bool]:
    """``(response, truncated)``: one response of ``kind`` (:data:`KINDS`) to ``example``."""
    words = [w.strip(".,?!$") for w in example.prompt.split() if w.strip(".,?!$")] or ["it"]
    answer = example.answer
    wrong = str(int(answer) + rng.choice([-3, -1, 1, 2, 10])) if answer.lstrip("-").isdigit() \
        else "7"
    steps = _ramble(rng, words, rng.randint(150, 500))
    if kind == "hash_right":
        return f"{steps}.\n#### {answer}", False
    if kind == "hash_wrong":
        return f"{steps}.\n#### {wrong}", False
    if kind == "answer_is":
        return f"{steps}.\nThe answer is {rng.choice([answer, wrong])}.", False
    if kind == "ended_ramble":
        return _ramble(rng, words, rng.randint(200, 700)) + ".", False
    if kind == "truncated":  # 256 tokens of ~4 characters, cut mid-word
        return _ramble(rng, words, rng.randint(950, 1150))[:rng.randint(900, 1100)], True
    if kind == "latex":
        a, b = rng.randint(1, 99), rng.randint(2, 12)
        return (f"{steps}. So $\\frac{{{a}}}{{{b}}} \\times {b} = {a}$ and "
                f"\\({a} + {b}\\) is \\boxed{{{rng.choice([answer, wrong])}}}"), False
    return _ramble(rng, words, rng.randint(700, 1000), odd=0.15)[:1000], True  # unicode


KIND_WEIGHTS = {"hash_right": 0.03, "hash_wrong": 0.07, "answer_is": 0.1, "ended_ramble": 0.17,
                "truncated": 0.48, "latex": 0.05, "unicode": 0.1}


def make_rows(examples: Sequence[Example], n: int, seed: int
              ) -> List[Tuple[str, str, Example, bool]]:
    """``n`` rows ``(kind, response, example, truncated)``: prompts of 8 responses each, kinds
    drawn by :data:`KIND_WEIGHTS` (~58% cut at the budget: the H100 run's 0.54-0.66)."""
    rng = random.Random(seed)
    rows = []
    kinds, weights = zip(*KIND_WEIGHTS.items())
    for i in range(n):
        example = examples[(seed * 31 + i // 8) % len(examples)]
        kind = rng.choices(kinds, weights)[0]
        text, truncated = model_like(example, kind, rng)
        rows.append((kind, text, example, truncated))
    return rows


def real_rows(path: str, n: int, seed: int) -> List[Tuple[str, str, Example, bool]]:
    """``n`` rows of ``--responses`` (drawn again in a shuffled order past its length), kind
    ``truncated`` or ``ended``."""
    from mcore_rl.rewards.math import gold_answer

    records = json.load(open(path))
    rng = random.Random(seed)
    picked = [records[rng.randrange(len(records))] for _ in range(n)]
    return [("truncated" if r["truncated"] else "ended", r["response"],
             Example(prompt="", answer=gold_answer(r["answer"]), solution="", source=path),
             bool(r["truncated"])) for r in picked]


def rows_of(args, seed: int, n: int = 0):
    """``n`` rows (default ``--rows``) of ``--responses``, else :func:`make_rows` of
    ``--data``."""
    if args.responses:
        return real_rows(args.responses, n or args.rows, seed)
    from mcore_rl.data.gsm8k import load_gsm8k

    return make_rows(load_gsm8k(args.data), n or args.rows, seed)


# ---------------------------------------------------------------------- 1. per row, by kind
def per_row(args) -> None:
    """(in a fresh process) time each row once; print JSON ``{kind: [ms, ...]}`` and the
    import and warm-up milliseconds."""
    start = time.perf_counter()
    from mcore_rl.rewards import math as math_module

    imported = time.perf_counter() - start
    rows = rows_of(args, seed=1)
    random.Random(2 + args.seed).shuffle(rows)
    start = time.perf_counter()
    if args.per_row == "warm":
        math_module.warm_up()
    warm = time.perf_counter() - start
    times: Dict[str, List[float]] = {}
    steps: List[float] = []  # one pool process's steps: the slowest row of each
    if args.seed:  # the steps, first thing in the process
        rows = []
    for kind, text, example, _ in rows:
        start = time.perf_counter()
        math_module.math_reward(text, example)
        times.setdefault(kind, []).append(1e3 * (time.perf_counter() - start))
    for step in range(args.process_steps if args.seed else 0):
        slowest = 0.0
        for _, text, example, _ in rows_of(args, seed=1000 * args.seed + step,
                                           n=args.process_rows):
            start = time.perf_counter()
            math_module.math_reward(text, example)
            slowest = max(slowest, 1e3 * (time.perf_counter() - start))
        steps.append(slowest)
    print(json.dumps({"import_ms": 1e3 * imported, "warm_up_ms": 1e3 * warm, "times": times,
                      "steps": steps}))


def table_per_row(args) -> None:
    results, steps = {}, {"cold": [], "warm": []}
    for seed in range(4):  # 0: the rows by kind; 1-3: a process's steps
        for mode in ("cold", "warm"):
            cmd = [sys.executable, os.path.abspath(__file__), "--per-row", mode, "--rows",
                   str(args.rows), "--data", args.data, "--seed", str(seed),
                   "--process-rows", str(args.process_rows),
                   "--process-steps", str(args.process_steps)] + (
                ["--responses", args.responses] if args.responses else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            if seed:
                steps[mode].append(result["steps"])
            else:
                results[mode] = result
    print(f"\n1. math_reward per row, one fresh process each (import "
          f"{results['cold']['import_ms']:.0f} ms; warm_up {results['warm']['warm_up_ms']:.0f} ms)")
    print("| kind | rows | cold median / p90 / max ms | warm median / p90 / max ms |")
    print("| --- | ---: | ---: | ---: |")
    kinds = [k for k in (*KINDS, "ended") if k in results["cold"]["times"]]
    for kind in kinds + ["all"]:
        cells = []
        for mode in ("cold", "warm"):
            t = results[mode]["times"]
            ms = sorted(sum(t.values(), [])) if kind == "all" else sorted(t[kind])
            cells.append(f"{ms[len(ms) // 2]:.2f} / {ms[int(0.9 * (len(ms) - 1))]:.2f} / "
                         f"{ms[-1]:.1f}")
        n = sum(len(v) for v in results["cold"]["times"].values()) if kind == "all" \
            else len(results["cold"]["times"][kind])
        print(f"| {kind} | {n} | {cells[0]} | {cells[1]} |")
    for mode in ("cold", "warm"):
        total = sum(sum(v) for v in results[mode]["times"].values())
        print(f"{mode}: all rows {total:.0f} ms")
    print(f"\nOne pool process, {args.process_rows} rows a step: the slowest row of each step, ms "
          f"(cold / warm), one line per fresh process")
    print("| process | " + " | ".join(f"step {k + 1}" for k in range(args.process_steps)) + " |")
    print("| --- |" + " ---: |" * args.process_steps)
    for seed, (cold, warm) in enumerate(zip(steps["cold"], steps["warm"])):
        print(f"| {seed + 1} | " + " | ".join(f"{c:.0f} / {w:.0f}" for c, w in zip(cold, warm))
              + " |")


# ---------------------------------------------------------------------- 2. round trip
def table_round_trip(args) -> None:
    from mcore_rl.rewards.exact import exact_reward
    from mcore_rl.rewards.math import math_reward
    from mcore_rl.rewards.pool import RewardScorer

    rows = rows_of(args, seed=3)
    print(f"\n2. The pool's round trip ({args.workers} processes, {len(rows)} rows, best of 3)")
    print("| reward | wall ms per row | wall ms | busy ms | controller CPU ms | one row alone ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    cases = [("exact (trivial)", exact_reward, ["5"] * len(rows),
              [Example(prompt="", answer="5", solution="5", source="b")] * len(rows)),
             ("math", math_reward, [r[1] for r in rows], [r[2] for r in rows])]
    for label, fn, texts, examples in cases:
        scorer = RewardScorer(fn, num_workers=args.workers, timeout_seconds=60)
        try:
            scorer.warm_up()
            scorer.score(texts, examples)
            best = (float("inf"), 0.0, 0.0)
            one = float("inf")
            for _ in range(3):
                start, cpu = time.perf_counter(), _cpu_seconds()
                _, _, busy = scorer.score(texts, examples)
                best = min(best, (time.perf_counter() - start, busy, _cpu_seconds() - cpu))
                start = time.perf_counter()
                scorer.score(texts[:1], examples[:1])
                one = min(one, time.perf_counter() - start)
        finally:
            scorer.close()
        wall, busy, cpu = best
        print(f"| {label} | {1e3 * wall / len(texts):.3f} | {1e3 * wall:.0f} | {1e3 * busy:.0f} | "
              f"{1e3 * cpu:.0f} | {1e3 * one:.2f} |")


def _cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread (user + system; not its children)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------- 3. the wait
def _stream(scorer, rows, decode_s: float) -> float:
    """Hand the ended rows over through ``decode_s`` seconds (shorter first), the truncated ones
    at its end; the seconds from the last hand-over to the rewards."""
    stream = scorer.open([r[2] for r in rows])
    ended = sorted((i for i, r in enumerate(rows) if not r[3]), key=lambda i: len(rows[i][1]))
    start = time.perf_counter()
    for j, i in enumerate(ended):
        due = start + decode_s * (0.3 + 0.7 * j / max(1, len(ended)))
        time.sleep(max(0.0, due - time.perf_counter()))
        stream.add([i], [rows[i][1]])
    time.sleep(max(0.0, start + decode_s - time.perf_counter()))
    last = [i for i, r in enumerate(rows) if r[3]]
    t = time.perf_counter()
    stream.add(last, [rows[i][1] for i in last])
    stream.close()
    stream.result()
    return time.perf_counter() - t


def table_wait(args) -> None:
    from mcore_rl.rewards.math import math_reward
    from mcore_rl.rewards.pool import RewardScorer

    print(f"\n3. The wait after generation ({args.workers} processes, {args.rows} rows a step, "
          f"decode {args.decode_s:g} s, fresh rows each step; seconds per step)")
    print("| rows scored | pool processes | " + " | ".join(f"step {s + 1}" for s in
                                                        range(args.steps)) + " | median |")
    print("| --- | --- |" + " ---: |" * (args.steps + 1))
    for mode in ("early", "after"):
        for warm in (False, True):
            scorer = RewardScorer(math_reward, num_workers=args.workers, timeout_seconds=60,
                                  warm_workers=warm)
            waits = []
            try:
                scorer.warm_up()
                for step in range(args.steps):
                    rows = rows_of(args, seed=100 + step)
                    if mode == "early":
                        waits.append(_stream(scorer, rows, args.decode_s))
                    else:
                        time.sleep(args.decode_s)  # the processes idle through generation
                        start = time.perf_counter()
                        scorer.score([r[1] for r in rows], [r[2] for r in rows])
                        waits.append(time.perf_counter() - start)
            finally:
                scorer.close()
            label = "warmed up" if warm else "not warmed (before)"
            print(f"| {mode} | {label} | " + " | ".join(f"{w:.3f}" for w in waits)
                  + f" | {statistics.median(waits):.3f} |")


def main() -> None:
    from mcore_rl.data.gsm8k import GSM8K_SAMPLE_DIR

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--decode-s", type=float, default=1.0)
    parser.add_argument("--data", default=str(GSM8K_SAMPLE_DIR / "train.jsonl"))
    parser.add_argument("--responses", default=None)
    parser.add_argument("--tables", default="1,2,3")
    parser.add_argument("--process-rows", type=int, default=18)
    parser.add_argument("--process-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--per-row", choices=["cold", "warm"], default=None,
                        help=argparse.SUPPRESS)  # table 1's fresh processes
    args = parser.parse_args()
    if args.per_row:
        per_row(args)
        return
    print(f"bench/reward_wait.py: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"rows {'of ' + args.responses if args.responses else 'model-like (make_rows)'}")
    tables = args.tables.split(",")
    if "1" in tables:
        table_per_row(args)
    if "2" in tables:
        table_round_trip(args)
    if "3" in tables:
        table_wait(args)


if __name__ == "__main__":
    main()
