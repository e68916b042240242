"""The streaming GRPO loop (``grpo.streaming: true``): prompt groups train as they finish.

Generation runs in processes of its own (a :class:`~mcore_rl.generation.base.StreamingBackend`:
the hf engine in ``generation.num_workers`` processes, or ``generation.vllm.num_engines`` vLLM
engines), a training micro-batch's worth of prompt groups per call, two calls queued per process. Each
finished group comes back with ``trainer_version``, the policy version of the weights that
generated it (the RL steps the policy had completed when they were taken). The controller
scores it, computes its GRPO advantages (per group, so the same as over the whole batch), gives
it to the DP rank with the fewest rows so far, and once a DP rank holds a micro-batch's worth of
rows gets their old (and reference) logprobs there and feeds them to ``train_microbatch`` on
that rank (the split train step, :class:`~mcore_rl.controller.worker_group.DataParallelGroup`);
generation, logprobs and training run at once. When ``grpo.num_prompts_per_step`` groups are
in, ``finish_train_step`` takes the optimizer step, and the new weights are pushed to the
generation processes, queued behind the calls they already hold.

Staleness. Training RL step ``s`` (the policy at version ``s``) on a group of version ``v`` has
staleness ``s - v``. Generation is let run ahead by ``grpo.max_staleness`` = k steps' worth of
groups, and the bound is enforced where groups are consumed: a group older than k is dropped
and its prompt queued to be generated again with newer weights (``stream/dropped_stale``);
never trained. With k = 0 the step's groups are those the synchronous loop samples (the same
prompts, seeds and per-row random streams, decoded with the same weights), so the parameters
are the synchronous loop's up to float rounding (the rows are summed in another order).

Failure. A micro-batch that raises, or a generation process that fails or dies, aborts the open
step (``abort_train_step`` on every rank: gradients dropped, weights untouched); the step's
groups go back to the front of the queue (those of a dead process's calls are generated again
elsewhere, with the same seeds and rows) and the step runs again, up to
``grpo.max_step_retries`` times; then the run stops with :class:`StepFailed`. A checkpoint is
only ever written between steps, so nothing half-trained reaches one.

Metrics (per RL step): ``stream/staleness_<j>`` (prompt groups trained at staleness j, j = 0..k:
the histogram), ``stream/staleness_mean`` (per sequence), ``stream/dropped_stale`` (prompt
groups), ``stream/step_retries``, ``stream/generation_workers`` (live processes), and wall
seconds of the step by what was running (:class:`BusyClock`): ``timing/generation_busy_s``,
``timing/trainer_busy_s``, ``timing/overlap_s`` (both), ``timing/idle_s`` (neither: the
controller alone), with ``timing/step_s``, ``timing/finish_s``, ``timing/refit_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Deque, Dict, List, Tuple

import torch

from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.grpo import GRPOTrainer
from mcore_rl.controller.trainer import step_seed
from mcore_rl.controller.worker_group import WorkerError
from mcore_rl.data import batch as B
from mcore_rl.generation.base import assemble_rollout

# Generation calls queued per process: one decoding, one waiting.
CALLS_PER_WORKER = 2


class StepFailed(RuntimeError):
    """An RL step failed more than ``grpo.max_step_retries`` times; it was aborted (no
    parameter changed)."""


class _Fault(Exception):
    """One failed try of a step (the reason as text)."""


@dataclasses.dataclass(frozen=True)
class PromptGroup:
    """One prompt to generate ``num_generations`` responses for: ``prompt`` (its index in the
    training set), the sampling ``seed`` and ``first_row`` (its rows' random streams: those of
    the synchronous loop's rollout of RL step ``drawn_at``)."""

    prompt: int
    seed: int
    first_row: int
    drawn_at: int


@dataclasses.dataclass
class ScoredGroup:
    """A finished, scored prompt group: ``rows`` (rollout keys plus ``rewards``,
    ``sample_mask``, ``advantages`` and ``trainer_version`` [N] int64), the policy ``version``
    that generated it, and its reward errors."""

    item: PromptGroup
    version: int
    rows: B.Batch
    reward_errors: int


class BusyClock:
    """Wall seconds split by what was running: generation calls outstanding, policy calls
    outstanding, both, neither. :meth:`mark` closes the interval since the last mark (it is
    charged to the state given then) and opens one in the new state."""

    def __init__(self) -> None:
        self.seconds = {"generation_busy": 0.0, "trainer_busy": 0.0, "overlap": 0.0, "idle": 0.0}
        self._last = time.perf_counter()
        self._state = (False, False)

    def mark(self, generating: bool, training: bool) -> None:
        now = time.perf_counter()
        dt, (gen, train) = now - self._last, self._state
        self.seconds["generation_busy"] += dt * gen
        self.seconds["trainer_busy"] += dt * train
        self.seconds["overlap"] += dt * (gen and train)
        self.seconds["idle"] += dt * (not gen and not train)
        self._last, self._state = now, (generating, training)


class StreamingGRPOTrainer(GRPOTrainer):
    """GRPO with the streaming loop of the module docstring (``grpo.streaming``,
    ``grpo.max_staleness``, ``grpo.max_step_retries``).

    Raises (at construction):
        ValueError: the rollout backend is not a
            :class:`~mcore_rl.generation.base.StreamingBackend` (the error names those that are).
    """

    def __init__(self, cfg: TrainConfig):
        from mcore_rl.generation.base import StreamingBackend
        from mcore_rl.generation.checks import STREAMING_BACKENDS

        super().__init__(cfg)
        if not isinstance(self.generation, StreamingBackend):
            name = type(self.generation).__name__
            self.close()
            raise ValueError(f"grpo.streaming=true needs a rollout engine in processes of its own "
                             f"({STREAMING_BACKENDS}); {name} is not one")
        self.todo: Deque[PromptGroup] = collections.deque()  # to generate
        # generation call -> (process, its prompt groups)
        self.generating: Dict[Future, Tuple[int, List[PromptGroup]]] = {}
        self.ready: Deque[ScoredGroup] = collections.deque()  # finished, not trained yet
        self.batches_drawn = 0  # sampler batches drawn (the synchronous loop draws one per step)
        self.dropped_stale = 0  # prompt groups dropped as stale in this RL step

    # ------------------------------------------------------------------ checkpoints
    def controller_state(self) -> Dict[str, Any]:
        """:meth:`RLTrainer.controller_state` plus the prompt groups drawn but not trained yet
        (generated again after a resume, with the resumed weights)."""
        pending = [*(sg.item for sg in self.ready),
                   *(item for _, items in self.generating.values() for item in items), *self.todo]
        return {**super().controller_state(), "batches_drawn": self.batches_drawn,
                "pending": [dataclasses.astuple(p) for p in pending]}

    def load_controller_state(self, state: Dict[str, Any]) -> None:
        super().load_controller_state(state)
        self.batches_drawn = state.get("batches_drawn", self.step)
        self.todo = collections.deque(PromptGroup(*p) for p in state.get("pending", []))
        self.ready.clear()

    # ------------------------------------------------------------------ refit
    def refit(self) -> Dict[str, float]:
        """Load the policy's weights into every generation process as version ``self.step``;
        waits (the start of a run, or of an evaluation)."""
        start = time.perf_counter()
        stats = self.generation.refit(self.policy, version=self.step)
        return {"refit/seconds": time.perf_counter() - start, **stats}

    # ------------------------------------------------------------------ generation
    def _draw(self) -> None:
        """The sampler's next batch of prompts into :attr:`todo` (seeded as the synchronous
        loop's rollout of that step)."""
        g, t = self.cfg.grpo, self.batches_drawn
        seed = step_seed(self.cfg.run.seed, t)
        self.todo.extend(PromptGroup(int(p), seed, i * g.num_generations, t)
                         for i, p in enumerate(self.sampler.next_batch()))
        self.batches_drawn += 1

    def _dispatch(self, wanted: int) -> None:
        """Start generation calls until ``wanted`` groups are generating or finished, or every
        live process holds :data:`CALLS_PER_WORKER` calls. A call decodes a training
        micro-batch's worth of prompt groups (``policy.micro_batch_size`` rows, at most
        ``generation.batch_size``; at least one group) whose rows follow each other in one
        sampler batch."""
        n = self.cfg.grpo.num_generations
        per_call = max(1, min(self.cfg.policy.micro_batch_size, self.cfg.generation.batch_size) // n)
        load = {w: 0 for w in self.generation.alive}
        for w, _ in self.generating.values():
            if w in load:
                load[w] += 1
        generating = sum(len(items) for _, items in self.generating.values())
        while len(self.ready) + generating < wanted and load:
            worker = min(load, key=load.get)
            if load[worker] >= CALLS_PER_WORKER:
                return
            if not self.todo:
                self._draw()
            items = [self.todo.popleft()]
            while (self.todo and len(items) < min(per_call, wanted - len(self.ready) - generating)
                   and self.todo[0].seed == items[0].seed
                   and self.todo[0].first_row == items[-1].first_row + n):
                items.append(self.todo.popleft())
            prompts = [list(self.train_data.input_ids[item.prompt]) for item in items for _ in range(n)]
            future = self.generation.submit(worker, prompts, items[0].seed, n, items[0].first_row)
            self.generating[future] = (worker, items)
            generating += len(items)
            load[worker] += 1

    def _generated(self, future: Future) -> None:
        """A finished generation call: its groups scored into :attr:`ready`; a failed one
        requeued (and its process dropped if it died), then :class:`_Fault`."""
        worker, items = self.generating.pop(future)
        try:
            version, groups = future.result()
        except WorkerError as e:
            self.todo.extendleft(reversed(items))
            if worker in e.gone:  # its other calls fail too: generated again elsewhere
                for f in [f for f, (w, _) in self.generating.items() if w == worker]:
                    self.todo.extendleft(reversed(self.generating.pop(f)[1]))
                self.generation.drop(worker)
                if not self.generation.alive:
                    raise StepFailed(f"RL step {self.step + 1}: every generation process is gone "
                                     f"(generation.num_workers={self.cfg.generation.num_workers}); "
                                     f"the last: {e}") from e
            raise _Fault(f"generation process {worker}: {e}") from e
        g = self.cfg.grpo
        for group in groups:
            item = items[group.rows.start // g.num_generations]
            prompts = [list(self.train_data.input_ids[item.prompt])] * g.num_generations
            rows = assemble_rollout(prompts, group.responses, self.generation.pad_token_id)
            with self.timer.phase("reward"):
                rewards, errors, _ = self._score(
                    rows, [self.train_data.examples[item.prompt]] * len(prompts))
            rows["rewards"] = rewards
            rows["sample_mask"] = torch.ones(len(prompts))
            self._shape_rewards(rows)
            self._set_advantages(rows)  # a per-group estimator (load-time check)
            rows["trainer_version"] = torch.full((len(prompts),), version, dtype=torch.long)
            self.ready.append(ScoredGroup(item, version, rows, errors))

    # ------------------------------------------------------------------ the step
    def rl_step(self) -> Dict[str, float]:
        """One streamed RL step (module docstring); returns its metrics.

        Raises:
            StepFailed: the step failed ``grpo.max_step_retries`` + 1 times, or every
                generation process is gone; it is aborted, the parameters are those before it.
        """
        g = self.cfg.grpo
        start = time.perf_counter()
        clock = BusyClock()
        self.dropped_stale = retries = 0
        while True:
            try:
                fed, chunks = self._try_step(clock)
                break
            except _Fault as fault:
                retries += 1
                if retries > g.max_step_retries:
                    raise StepFailed(
                        f"RL step {self.step + 1} failed {retries} time(s) and was aborted "
                        f"(grpo.max_step_retries={g.max_step_retries}); the last failure: "
                        f"{fault}") from fault.__cause__
        with self.timer.phase("finish"):
            clock.mark(bool(self.generating), True)
            train_metrics = self.policy.finish_train_step()
        with self.timer.phase("refit"):
            refit_start = time.perf_counter()
            pushed = self.generation.push(self.policy, self.step + 1)
            clock.mark(bool(self.generating), False)
            refit = {"refit/seconds": time.perf_counter() - refit_start, "refit/gbytes": pushed.gbytes}
        clock.mark(bool(self.generating), False)

        rollout = B.concat(chunks)
        metrics = self.rollout_metrics(rollout, sum(sg.reward_errors for sg in fed))
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update(refit)
        staleness = [self.step - sg.version for sg in fed]
        for j in range(g.max_staleness + 1):
            metrics[f"stream/staleness_{j}"] = float(staleness.count(j))
        metrics["stream/staleness_mean"] = float(sum(staleness)) / len(staleness)
        metrics["stream/dropped_stale"] = float(self.dropped_stale)
        metrics["stream/step_retries"] = float(retries)
        metrics["stream/generation_workers"] = float(len(self.generation.alive))
        metrics.update(self.timer.pop())
        metrics.update({f"timing/{k}_s": v for k, v in clock.seconds.items()})
        metrics["timing/step_s"] = time.perf_counter() - start
        return metrics

    def _try_step(self, clock: BusyClock) -> Tuple[List[ScoredGroup], List[B.Batch]]:
        """One try of the step: begin, feed groups as they are ready (counting those dropped as
        stale in :attr:`dropped_stale`), wait for every micro-batch. Returns the groups trained
        (in feeding order) and the chunks fed (with their logprobs).

        Raises:
            _Fault: a policy or generation call failed: the step is aborted on every rank and
                its groups are back at the front of :attr:`ready`.
        """
        g, policy = self.cfg.grpo, self.policy
        need, mbs = g.num_prompts_per_step, self.cfg.policy.micro_batch_size
        policy.begin_train_step(self.loss_fn, need * g.num_generations, mbs)
        fed: List[ScoredGroup] = []
        buffers: List[List[ScoredGroup]] = [[] for _ in range(policy.dp_size)]
        dp_rows = [0] * policy.dp_size
        # the chunk's last logprob call -> (DP rank, chunk, its logprob calls)
        logprobs: Dict[Future, Tuple[int, B.Batch, List[Future]]] = {}
        training: set = set()  # train_microbatch calls outstanding
        chunks: List[B.Batch] = []

        def flush(d: int) -> None:
            chunk = B.concat([sg.rows for sg in buffers[d]])
            buffers[d].clear()
            methods = ["get_logprobs"] + (["get_reference_logprobs"] if self.use_reference else [])
            lp = [policy.call_per_dp_async(m, [[chunk, self.cfg.policy.logprob_micro_batch_size]],
                                           dp_ranks=[d]) for m in methods]
            logprobs[lp[-1]] = (d, chunk, lp)  # a DP rank answers in call order: last is last

        try:
            while True:
                while self.ready and len(fed) < need:
                    sg = self.ready.popleft()
                    if self.step - sg.version > g.max_staleness:
                        self.todo.append(sg.item)  # generated again with newer weights
                        self.dropped_stale += 1
                        continue
                    d = min(range(policy.dp_size), key=dp_rows.__getitem__)
                    buffers[d].append(sg)
                    fed.append(sg)
                    dp_rows[d] += g.num_generations
                    if sum(B.batch_size(x.rows) for x in buffers[d]) >= mbs:
                        flush(d)
                if len(fed) == need:
                    for d in range(policy.dp_size):
                        if buffers[d]:
                            flush(d)
                self._dispatch(need - len(fed) + g.max_staleness * need)
                clock.mark(bool(self.generating), bool(logprobs or training))
                if len(fed) == need and not logprobs and not training:
                    return fed, chunks
                done, _ = wait([*self.generating, *logprobs, *training], return_when=FIRST_COMPLETED)
                clock.mark(bool(self.generating), bool(logprobs or training))
                for f in done:
                    if f in self.generating:
                        self._generated(f)
                    elif f in logprobs:
                        d, chunk, lp = logprobs.pop(f)
                        chunk["prev_logprobs"] = lp[0].result()[0]
                        if self.use_reference:
                            chunk["reference_logprobs"] = lp[1].result()[0]
                        chunks.append(chunk)
                        training.add(policy.train_microbatch(chunk, d))
                    else:
                        training.discard(f)
                        f.result()
        except BaseException as e:
            # Close the step on every rank once its calls are answered; its groups go back.
            wait([x for _, _, lp in logprobs.values() for x in lp] + list(training))
            policy.abort_train_step()
            self.ready.extendleft(reversed(fed))
            if isinstance(e, WorkerError):
                raise _Fault(str(e)) from e
            raise
