"""The streaming loop (``grpo.streaming`` / ``ppo.streaming``): prompt groups train as they finish.

Generation runs in processes of its own (a :class:`~mcore_rl.generation.base.StreamingBackend`:
the hf engine in ``generation.num_workers`` processes, or ``generation.vllm.num_engines`` vLLM
engines), a decoding batch (``generation.batch_size`` rows) of prompt groups per call, two calls
queued per process. Each finished group comes back with ``trainer_version``, the policy
version of the weights that generated it (the policy updates done when they were taken). The
controller scores it (GRPO: its group advantages too, per group, so the same as over the whole
batch), gives it to the policy's DP rank with the fewest rows so far, and once a DP rank holds
a micro-batch's worth of rows (a chunk) takes the chunk's old (and reference) logprobs there
(PPO: and the critic's values on the critic's DP rank with the fewest rows); when they are in
(PPO: then the chunk's token rewards and GAE advantages and returns, exact per chunk since GAE
runs per sequence) it feeds the chunk to ``train_microbatch`` of every split step of the RL step
(GRPO: the policy's; PPO: the critic's and the policy's, the critic's alone in the
``ppo.critic_warmup_steps``), :class:`~mcore_rl.distributed.worker_group.DataParallelGroup`.
Generation, the forward passes and training run at once. When ``num_prompts_per_step`` groups
are in, ``finish_train_step`` takes the optimizer steps (PPO: the critic's first, as the
synchronous loop), and the new policy weights are pushed to the generation processes, queued
behind the calls they already hold.

Old logprobs and the logprob budget. With ``loss.prev_logprobs=recompute`` a chunk's
``prev_logprobs`` are the policy's forward of it, and the budget's figures, over the step's
rows decoded by the weights being trained, are checked before ``finish_train_step`` (an
aborted step trains nothing). With ``train_forward`` (GRPO) a chunk takes no logprob forward:
the weights stay those of the step's start until its one optimizer step in
``finish_train_step``, after every chunk has trained, so the training forward's own logprobs,
detached, are the recomputed ones; a stale row's importance weights ``exp(old - generation)``
are unchanged, since the weights that decoded it enter only through ``generation_logprobs``.
Each chunk carries ``on_policy`` [rows] (1 where ``trainer_version`` is the step's version),
the loss measures the figures over those rows, and the budget counts them after
``finish_train_step``, before the refit (:meth:`LogprobBudget.observe_trained
<mcore_rl.controller.logprob_budget.LogprobBudget.observe_trained>`).

The logprob canary. With ``max_staleness >= 1`` a step may train no row decoded by its own
weights (at staleness 1 with generation ahead, every step after the first), and a refit that
broke the engine's weights would then go unmeasured. So right after each push the loop submits
a canary of the pushed version to the generation process with the fewest calls, queued behind
the new weights: the start-up canary's prompts (:meth:`RLTrainer.canary_prompts
<mcore_rl.controller.trainer.RLTrainer.canary_prompts>`: the first
``generation.logprob_canary_prompts`` training prompts, one response each, a seed of their
own). When its decoding is in (during the next step, beside the chunks) and that step has fed
no row of its version yet, the policy's logprob forward of it starts on the DP rank with the
fewest rows; the weights are that version until the step's ``finish_train_step``. A step
without a row decoded by its weights waits for the canary before ``finish_train_step`` (both
``prev_logprobs`` modes) and counts its figures (:meth:`LogprobBudget.observe
<mcore_rl.controller.logprob_budget.LogprobBudget.observe>` with ``canary``), so ``k`` such
steps over budget stop the run as on-policy rows do, the ``k``-th aborted before its optimizer
step. A step with such rows counts them and drops the canary. No canary with
``max_staleness=0`` (every trained row is on-policy), after the last step, without a budget or
with 0 canary prompts; one whose decoding or forward failed, or a refit or resume that replaced
its weights, drops it (a warning; its step is not counted).

What needs the whole batch before its first rows train cannot stream, and is refused at load
time (:func:`mcore_rl.config.loader.streaming_errors`): GRPO's batch-wide estimator
(REINFORCE++), dynamic sampling and ``grpo.optimizer_steps_per_rollout > 1``; PPO's advantage
whitening (``ppo.whiten_advantages``: the batch's mean and std), ``ppo.ppo_epochs > 1`` and
``ppo.num_mini_batches > 1``. Streaming PPO is therefore one critic and one policy step per
RL step on unwhitened GAE advantages, with the reward KL and critic warm-up of the synchronous
loop.

Staleness. Training at policy version ``s`` on a group of version ``v`` has staleness
``s - v`` (the version counts policy updates: RL steps, less PPO's critic warm-up steps).
Generation is let run ahead by ``max_staleness`` = k steps' worth of groups, and the bound is
enforced where groups are consumed: a group older than k is dropped and its prompt queued to be
generated again with newer weights (``stream/dropped_stale``); never trained. With k = 0 the
step's groups are those the synchronous loop samples (the same prompts, seeds and per-row
random streams, decoded with the same weights), so the parameters (policy and critic) are the
synchronous loop's up to float rounding (the rows are summed in another order).

Failure. A micro-batch or forward pass that raises, or a generation process that fails or dies,
aborts the open step (``abort_train_step`` of every split step on every rank: gradients
dropped, weights untouched); the step's groups go back to the front of the queue (those of a
dead process's calls are generated again elsewhere, with the same seeds and rows) and the step
runs again, up to ``max_step_retries`` times; then the run stops with :class:`StepFailed`. A
``finish_train_step`` that raises closes the other split steps and stops the run (PPO: when the
policy's raises, the critic has already stepped). A checkpoint is only ever written between
steps, so nothing half-trained reaches one.

Checkpoints (exact resume). A save first waits for the generation calls in flight
(:meth:`StreamingLoop.drain`), so every drawn, untrained group is either finished or not yet
dispatched. The checkpoint keeps the finished ones with their rollouts (rows, rewards, what the
algorithm scored, the version that decoded them: ``controller.pt``) and the others as prompts,
with the sampler's state and the batches drawn. After a resume the finished groups train as
they would have in the straight run (at the same staleness; one too old for ``max_staleness``
is dropped and generated again by the rule above), and the others are decoded with the version
a straight run would use: a call dispatched after step ``s`` meets the weights pushed at the end
of step ``s``, which the refit of a resume loads. Where generation is not limited by the calls
each process may hold, so which groups a step trains does not depend on timing, a resumed run's
parameters are the straight run's (tests/test_streaming_resume.py). A checkpoint without the
finished groups (saved before they were kept) generates them again after the resume.

Metrics (per RL step): ``stream/staleness_<j>`` (prompt groups trained at staleness j, j = 0..k:
the histogram), ``stream/staleness_mean`` (per sequence), ``stream/dropped_stale`` (prompt
groups), ``stream/step_retries``, ``stream/generation_workers`` (live processes), and wall
seconds of the step by what was running (:class:`BusyClock`): ``timing/generation_busy_s``,
``timing/trainer_busy_s``, ``timing/overlap_s`` (both), ``timing/idle_s`` (neither: the
controller alone), with ``timing/step_s``, ``timing/finish_s``, ``timing/refit_s``;
``generation/tokens_per_s`` is the step's response tokens over its generation-busy seconds.
A step the canary measured logs its figures as ``canary/token_mult_prob_error``,
``canary/logprob_mismatch_mean`` and ``canary/logprob_mismatch_max``, and the seconds it waited
for the canary before ``finish_train_step`` as ``timing/canary_wait_s``.
PPO adds the synchronous loop's ``critic/*`` figures (the algorithm's ``batch_metrics``:
:meth:`mcore_rl.controller.ppo.PPO.critic_metrics` over the step's rows, and the critic's step
as ``critic/<metric>``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from mcore_rl.controller.algorithm import Algorithm, SplitStep
from mcore_rl.controller.checkpoints import TENSORS_KEY
from mcore_rl.controller.logprob_budget import LogprobBudgetExceeded, mismatch_figures
from mcore_rl.controller.trainer import Loop, RLTrainer, step_seed
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import WorkerError
from mcore_rl.generation.base import assemble_rollout
from mcore_rl.workers.interfaces import PolicyAPI

_log = logging.getLogger(__name__)

# Generation calls queued per process: one decoding, one waiting.
CALLS_PER_WORKER = 2


class StepFailed(RuntimeError):
    """An RL step failed more than ``<algorithm>.max_step_retries`` times; it was aborted (no
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
    ``sample_mask`` and ``trainer_version`` [N] int64; GRPO: ``advantages``), the policy
    ``version`` that generated it, and its reward errors."""

    item: PromptGroup
    version: int
    rows: B.Batch
    reward_errors: int


class BusyClock:
    """Wall seconds split by what was running: generation calls outstanding, trainer calls
    (policy or critic) outstanding, both, neither. :meth:`mark` closes the interval since the last mark (it is
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




@dataclasses.dataclass
class _Chunk:
    """Rows fed to the split steps together, with the forward calls whose results they wait
    for: ``calls`` maps a batch key (``prev_logprobs``, ...) to its call, ``dp_ranks`` a
    worker group's name to the DP rank that takes the chunk."""

    rows: B.Batch
    dp_ranks: Dict[str, int]
    calls: Dict[str, Future]


@dataclasses.dataclass
class _Canary:
    """The logprob canary of policy ``version`` (module docstring): its ``prompts``, the
    generation call decoding them (``decoding``: a future of ``(version, groups)``), then their
    ``rollout`` and the policy's logprob forward of it (``forward``: a future of one
    ``[rows, S]`` tensor per DP rank called)."""

    version: int
    prompts: List[List[int]]
    decoding: Future
    rollout: Optional[B.Batch] = None
    forward: Optional[Future] = None


class StreamingLoop(Loop):
    """The streaming loop of the module docstring on ``trainer`` with ``algorithm``, whose
    section gives ``streaming``, ``max_staleness``, ``max_step_retries``,
    ``num_prompts_per_step`` and ``num_generations``; the generation processes of a
    :class:`~mcore_rl.generation.base.StreamingBackend`.

    The algorithm's hooks (:class:`~mcore_rl.controller.algorithm.Algorithm`):
    ``score_group`` (a scored group's own extras), ``chunk_calls`` (forward passes a chunk
    needs beyond the policy's logprobs), ``prepare_chunk`` (what a chunk computes from them),
    ``split_steps`` (the groups whose split steps run this step), ``policy_version`` and
    ``batch_metrics``.

    Raises (at construction):
        ValueError: the rollout backend is not a
            :class:`~mcore_rl.generation.base.StreamingBackend` (the error names those that
            are); the trainer is closed.
    """

    def __init__(self, trainer: RLTrainer, algorithm: Algorithm):
        from mcore_rl.generation.base import StreamingBackend
        from mcore_rl.generation.checks import STREAMING_BACKENDS

        super().__init__(trainer, algorithm)
        if not isinstance(trainer.generation, StreamingBackend):
            name = type(trainer.generation).__name__
            trainer.close()
            raise ValueError(f"{algorithm.name}.streaming=true needs a rollout engine in processes "
                             f"of its own ({STREAMING_BACKENDS}); {name} is not one")
        self.todo: Deque[PromptGroup] = collections.deque()  # to generate
        # generation call -> (process, its prompt groups)
        self.generating: Dict[Future, Tuple[int, List[PromptGroup]]] = {}
        self.ready: Deque[ScoredGroup] = collections.deque()  # finished, not trained yet
        self.batches_drawn = 0  # sampler batches drawn (the synchronous loop draws one per step)
        self.dropped_stale = 0  # prompt groups dropped as stale in this RL step
        # the logprob canary of the weights pushed last, while it may still be needed
        self.canary: Optional[_Canary] = None

    @property
    def train_forward(self) -> bool:
        """``loss.prev_logprobs=train_forward``: no logprob forward per chunk; the training
        forward takes its own logprobs as the old policy's and measures the logprob budget's
        figures (module docstring)."""
        return self.trainer.cfg.loss.prev_logprobs == "train_forward"

    def _chunk_calls(self, chunk: B.Batch, dp_ranks: Dict[str, int]) -> Dict[str, Future]:
        """Start the forward passes ``chunk`` needs before it trains, on the DP ranks
        ``dp_ranks`` (by worker group name); returns each call by the batch key its result
        ``[rows, S]`` goes under: the policy's ``prev_logprobs`` (none with
        ``loss.prev_logprobs=train_forward``: the weights are those the chunk trains with, the
        step's one optimizer step comes after every chunk's calls) and ``reference_logprobs``,
        then the algorithm's (:meth:`Algorithm.chunk_calls`); possibly none. A DP rank answers
        its calls in order."""
        tr = self.trainer
        policy = tr.policy.call_per_dp_async(PolicyAPI, dp_ranks=[dp_ranks["policy"]])
        args = [[chunk, tr.cfg.policy.logprob_micro_batch_size]]
        calls = {}
        if not self.train_forward:
            calls["prev_logprobs"] = policy.get_logprobs(args)
        if tr.use_reference:
            calls["reference_logprobs"] = policy.get_reference_logprobs(args)
        calls.update(self.algorithm.chunk_calls(tr, chunk, dp_ranks))
        return calls

    # ------------------------------------------------------------------ checkpoints
    def drain(self) -> None:
        """Wait for every generation call in flight and take its groups into :attr:`ready`
        (scored, with the version that decoded them), in the order the calls finish, as the
        loop would have; a failed call's groups go back to the front of :attr:`todo` (its
        process dropped if it died). Between steps (:meth:`save`), so that a checkpoint's state
        does not depend on how far generation got.

        Raises:
            StepFailed: every generation process is gone.
        """
        while self.generating:
            done, _ = wait(list(self.generating), return_when=FIRST_COMPLETED)
            for future in [f for f in self.generating if f in done]:  # in dispatch order
                if future not in self.generating:  # a dead process's call, requeued
                    continue
                try:
                    self._generated(future)
                except _Fault:
                    pass  # its groups are back in todo: generated again after the resume

    def save(self) -> str:
        """:meth:`drain`, then :meth:`Loop.save`: the checkpoint holds every finished,
        untrained group with its rollouts and version (:meth:`controller_tensors`)."""
        self.drain()
        return super().save()

    def controller_state(self) -> Dict[str, Any]:
        """:meth:`Loop.controller_state` plus the sampler batches drawn, the finished,
        untrained groups (``ready``: their prompt group, version and reward errors; their rows
        in :meth:`controller_tensors`) and the prompt groups drawn but not generated
        (``pending``: in flight, none after :meth:`drain`, or not dispatched; generated after a
        resume with the resumed weights, as a straight run generates them with the same
        version: a call dispatched after step ``s`` is decoded with the weights of version
        ``algorithm.policy_version(s)``, pushed at its end or loaded by the refit of a resume)."""
        pending = [*(item for _, items in self.generating.values() for item in items), *self.todo]
        return {**super().controller_state(), "batches_drawn": self.batches_drawn,
                "pending": [dataclasses.astuple(p) for p in pending],
                "ready": [[*dataclasses.astuple(sg.item), sg.version, sg.reward_errors]
                          for sg in self.ready]}

    def controller_tensors(self) -> List[B.Batch]:
        """The rows of each group of ``ready`` (:meth:`controller_state`), in its order: the
        rollout keys with ``rewards``, ``sample_mask``, ``trainer_version`` and what the
        algorithm scored (:meth:`Algorithm.score_group`)."""
        return [sg.rows for sg in self.ready]

    def load_controller_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`controller_state`: the finished groups into :attr:`ready` (to train
        first, as in the run that saved them; one too old for ``max_staleness`` at the step
        that meets it is dropped and generated again by the loop's rule), the others into
        :attr:`todo`. A checkpoint from before ``ready`` was kept holds every untrained group
        in ``pending``: all are generated again."""
        super().load_controller_state(state)
        self.canary = None  # of weights the loaded ones replace
        self.batches_drawn = state.get("batches_drawn", self.trainer.step)
        self.todo = collections.deque(PromptGroup(*p) for p in state.get("pending", []))
        self.ready.clear()
        rows = state.get(TENSORS_KEY) or []
        for (*item, version, errors), group in zip(state.get("ready", []), rows, strict=True):
            self.ready.append(ScoredGroup(PromptGroup(*item), version, group, errors))

    # ------------------------------------------------------------------ refit
    def refit(self) -> Dict[str, float]:
        """Load the policy's weights into every generation process as the version of RL step
        ``self.trainer.step``; waits (the start of a run, or of an evaluation)."""
        start = time.perf_counter()
        tr = self.trainer
        self.canary = None  # of weights this refit replaces
        stats = tr.generation.refit(tr.policy, version=self.algorithm.policy_version(tr.step))
        return {"refit/seconds": time.perf_counter() - start, **stats}

    # ------------------------------------------------------------------ the logprob canary
    def _start_canary(self) -> None:
        """Right after a push of the weights of the next RL step (``trainer.step + 1``,
        0-based): the canary of that version (module docstring), :meth:`RLTrainer.
        canary_prompts` with one response each, submitted to the live generation process with
        the fewest calls, behind the pushed weights. Nothing where the next step cannot lack
        rows decoded by its weights (``max_staleness=0``: older rows are dropped), where there
        is no next step (``max_steps``), or without a budget or canary prompts."""
        tr = self.trainer
        self.canary = None
        prompts = tr.canary_prompts()
        if (not prompts or tr.section.max_staleness == 0 or tr.step + 1 >= tr.section.max_steps
                or not tr.generation.alive):
            return
        load = self._calls_per_worker()
        worker = min(load, key=load.get)
        decoding = tr.watchdog.track("generation", tr.generation.submit(
            worker, prompts, tr.canary_seed(tr.step + 1), 1, 0))
        self.canary = _Canary(self.algorithm.policy_version(tr.step + 1), prompts, decoding)

    def _forward_canary(self, dp_rank: int) -> None:
        """The canary's decoding is done: its rollout assembled and the policy's logprob
        forward of it started on DP rank ``dp_rank`` (answered after the calls that rank
        holds; the weights are the step's until its ``finish_train_step``). A decoding that
        failed (its process died, or a failed refit) or was decoded by other weights than the
        canary's version drops the canary, with a warning: its step is then not counted."""
        c, tr = self.canary, self.trainer
        try:
            version, groups = c.decoding.result()
        except WorkerError as e:
            _log.warning("logprob canary of policy version %d: its generation call failed (%s); "
                         "RL step %d is not counted by generation.logprob_budget",
                         c.version, e, tr.step + 1)
            self.canary = None
            return
        if version != c.version:
            _log.warning("logprob canary: decoded by policy version %d, not %d; RL step %d is not "
                         "counted by generation.logprob_budget", version, c.version, tr.step + 1)
            self.canary = None
            return
        responses: List[Any] = [None] * len(c.prompts)
        for group in groups:
            responses[group.rows.start:group.rows.stop] = group.responses
        c.rollout = assemble_rollout(c.prompts, responses, tr.generation.pad_token_id)
        policy = tr.policy.call_per_dp_async(PolicyAPI, dp_ranks=[dp_rank])
        c.forward = tr.watchdog.track("logprobs", policy.get_logprobs(
            [[c.rollout, tr.cfg.policy.logprob_micro_batch_size]]))

    def _canary_figures(self, version: int) -> Optional[Dict[str, float]]:
        """The :func:`~mcore_rl.controller.logprob_budget.mismatch_figures` of the canary of
        policy ``version``, waited for (its forward started on DP rank 0 if it was not yet);
        the canary is consumed. None without such a canary, or when it failed (a warning)."""
        c = self.canary
        if c is None or c.version != version:
            return None
        if c.forward is None:
            self._forward_canary(0)  # waits for the decoding
            if self.canary is None:
                return None
        self.canary = None
        try:
            c.rollout["prev_logprobs"] = c.forward.result()[0]
        except WorkerError as e:
            _log.warning("logprob canary of policy version %d: the policy's logprob forward "
                         "failed (%s); RL step %d is not counted by generation.logprob_budget",
                         version, e, self.trainer.step + 1)
            return None
        return mismatch_figures(c.rollout)

    # ------------------------------------------------------------------ generation
    def _draw(self) -> None:
        """The sampler's next batch of prompts into :attr:`todo` (seeded as the synchronous
        loop's rollout of that step)."""
        n, t = self.trainer.section.num_generations, self.batches_drawn
        seed = step_seed(self.trainer.cfg.run.seed, t)
        self.todo.extend(PromptGroup(int(p), seed, i * n, t)
                         for i, p in enumerate(self.trainer.sampler.next_batch()))
        self.batches_drawn += 1

    def _calls_per_worker(self) -> Dict[int, int]:
        """The loop's generation calls in flight per live generation process (the canary's
        not counted)."""
        load = {w: 0 for w in self.trainer.generation.alive}
        for w, _ in self.generating.values():
            if w in load:
                load[w] += 1
        return load

    def _dispatch(self, wanted: int) -> None:
        """Start generation calls until ``wanted`` groups are generating or finished, or every
        live process holds :data:`CALLS_PER_WORKER` calls. A call decodes one decoding batch
        of prompt groups (``generation.batch_size`` rows; at least one group) whose rows follow
        each other in one sampler batch: a batched engine's step costs about the same for few
        rows as for many (on a GPU), so smaller calls would only slow generation down (4x
        measured with 64-row calls against 256-row ones, bench/RESULTS.md)."""
        n = self.trainer.section.num_generations
        per_call = max(1, self.trainer.cfg.generation.batch_size // n)
        load = self._calls_per_worker()
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
            prompts = [list(self.trainer.train_data.input_ids[item.prompt]) for item in items for _ in range(n)]
            future = self.trainer.watchdog.track("generation", self.trainer.generation.submit(
                worker, prompts, items[0].seed, n, items[0].first_row))
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
                self.trainer.generation.drop(worker)
                if not self.trainer.generation.alive:
                    raise StepFailed(f"RL step {self.trainer.step + 1}: every generation process is gone "
                                     f"(generation.num_workers, or generation.vllm.num_engines "
                                     f"with vllm); the last: {e}") from e
            raise _Fault(f"generation process {worker}: {e}") from e
        n = self.trainer.section.num_generations
        for group in groups:
            item = items[group.rows.start // n]
            prompts = [list(self.trainer.train_data.input_ids[item.prompt])] * n
            rows = assemble_rollout(prompts, group.responses, self.trainer.generation.pad_token_id)
            with self.trainer.timer.phase("reward"):
                rewards, errors, _ = self.trainer._score(
                    rows, [self.trainer.train_data.examples[item.prompt]] * len(prompts))
            rows["rewards"] = rewards
            rows["sample_mask"] = torch.ones(len(prompts))
            self.algorithm.score_group(rows)
            rows["trainer_version"] = torch.full((len(prompts),), version, dtype=torch.long)
            self.ready.append(ScoredGroup(item, version, rows, errors))

    # ------------------------------------------------------------------ the step
    def rl_step(self) -> Dict[str, float]:
        """One streamed RL step (module docstring); returns its metrics.

        Raises:
            StepFailed: the step failed ``max_step_retries`` + 1 times, or every generation
                process is gone; it is aborted, the parameters are those before it.
        """
        loop = self.trainer.section
        start = time.perf_counter()
        clock = BusyClock()
        steps = self.algorithm.split_steps(self.trainer, self.trainer.step)
        self.dropped_stale = retries = 0
        while True:
            try:
                fed, chunks = self._try_step(clock, steps)
                break
            except _Fault as fault:
                retries += 1
                if retries > loop.max_step_retries:
                    raise StepFailed(
                        f"RL step {self.trainer.step + 1} failed {retries} time(s) and was aborted "
                        f"({self.algorithm.name}.max_step_retries={loop.max_step_retries}); the last "
                        f"failure: {fault}") from fault.__cause__
        try:  # the logprob budget, before the optimizer step: may stop the run
            batch = B.concat(chunks)
            # Only rows decoded by the weights being trained measure the backend: a row decoded
            # one version back differs from them by the last optimizer step, as it should.
            # PPO: the critic warm-up trains no policy
            version = self.algorithm.policy_version(self.trainer.step)
            on_policy = torch.nonzero(batch["trainer_version"] == version).flatten()
            canary: Dict[str, float] = {}
            if len(on_policy):
                self.canary = None  # not needed: the step's own rows measure its weights
                if not self.train_forward:  # else after the update, below
                    self.trainer.check_logprob_budget(B.select(batch, on_policy))
            else:  # every row decoded by older weights: the canary of the step's weights
                wait_start = time.perf_counter()
                prompts = len(self.canary.prompts) if self.canary is not None else 0
                figures = self._canary_figures(version)
                if figures is not None:
                    canary = {f"canary/{k[len('train/'):]}": v for k, v in figures.items()}
                    canary["timing/canary_wait_s"] = time.perf_counter() - wait_start
                    self.trainer.logprob_budget.observe(self.trainer.step + 1, figures,
                                                        canary=prompts)
        except LogprobBudgetExceeded:
            for step in steps.values():
                step.group.abort_train_step()
            raise
        with self.trainer.timer.phase("finish"):
            clock.mark(bool(self.generating), True)
            step_metrics = self._finish(steps)
        trained = {f"{step.prefix}{k}": v for name, step in steps.items()
                   for k, v in step_metrics[name].items()}
        if self.train_forward and "policy" in steps:
            # the training forward's figures over the chunks' on_policy rows; after the
            # update, before its refit: may stop the run (nothing of the step saved)
            self.trainer.logprob_budget.observe_trained(self.trainer.step + 1, trained)
        metrics: Dict[str, float] = {}
        if "policy" in steps:
            with self.trainer.timer.phase("refit"):
                refit_start = time.perf_counter()
                pushed = self.trainer.generation.push(
                    self.trainer.policy, self.algorithm.policy_version(self.trainer.step + 1))
                clock.mark(bool(self.generating), False)
                metrics["refit/seconds"] = time.perf_counter() - refit_start
                metrics.update(pushed.stats())
            self._start_canary()  # queued behind the pushed weights
        clock.mark(bool(self.generating), False)

        rollout = B.concat(chunks)
        metrics.update(self.trainer.rollout_metrics(rollout, sum(sg.reward_errors for sg in fed),
                                            clock.seconds["generation_busy"]))
        metrics.update(self.algorithm.batch_metrics(rollout))
        metrics.update(trained)
        metrics.update(canary)
        version = self.algorithm.policy_version(self.trainer.step)
        staleness = [version - sg.version for sg in fed]
        for j in range(loop.max_staleness + 1):
            metrics[f"stream/staleness_{j}"] = float(staleness.count(j))
        metrics["stream/staleness_mean"] = float(sum(staleness)) / len(staleness)
        metrics["stream/dropped_stale"] = float(self.dropped_stale)
        metrics["stream/step_retries"] = float(retries)
        metrics["stream/generation_workers"] = float(len(self.trainer.generation.alive))
        metrics.update(self.trainer.timer.pop())
        metrics.update(self.trainer.reward_timing())
        metrics.update({f"timing/{k}_s": v for k, v in clock.seconds.items()})
        metrics["timing/step_s"] = time.perf_counter() - start
        return metrics

    def _finish(self, steps: Dict[str, SplitStep]) -> Dict[str, Dict[str, float]]:
        """``finish_train_step`` of every split step, in order; their metrics by group name.
        One that raises closes the others (those already finished have stepped) and
        re-raises."""
        out = {}
        try:
            for name, step in steps.items():
                out[name] = step.group.finish_train_step()
        except BaseException:
            for step in steps.values():
                step.group.abort_train_step()
            raise
        return out

    def _try_step(self, clock: BusyClock, steps: Dict[str, SplitStep]
                  ) -> Tuple[List[ScoredGroup], List[B.Batch]]:
        """One try of the step: begin the split ``steps``, feed groups as they are ready
        (counting those dropped as stale in :attr:`dropped_stale`), wait for every micro-batch.
        Returns the groups trained (in feeding order) and the chunks fed (with their forward
        results and what :meth:`Algorithm.prepare_chunk` added).

        Raises:
            _Fault: a worker call failed: the step is aborted on every rank of every split step
                and its groups are back at the front of :attr:`ready`.
        """
        loop, policy = self.trainer.section, self.trainer.policy
        need, n, mbs = loop.num_prompts_per_step, loop.num_generations, self.trainer.cfg.policy.micro_batch_size
        version = self.algorithm.policy_version(self.trainer.step)
        fed: List[ScoredGroup] = []
        buffers: List[List[ScoredGroup]] = [[] for _ in range(policy.dp_size)]
        dp_rows = {name: [0] * group.dp_size for name, group in self.trainer._groups().items()}
        waiting: Dict[Future, _Chunk] = {}  # a forward call -> the chunk that waits for it
        training: set = set()  # train_microbatch calls outstanding
        calls: List[Future] = []  # every worker call of this try, in the order made
        chunks: List[B.Batch] = []

        def flush(d: int) -> None:
            chunk = B.concat([sg.rows for sg in buffers[d]])
            buffers[d].clear()
            if self.train_forward:  # the rows whose mismatch the loss measures for the budget
                chunk["on_policy"] = (chunk["trainer_version"] == version).float()
            ranks = {"policy": d}
            for name, rows in dp_rows.items():
                if name != "policy":
                    ranks[name] = min(range(len(rows)), key=rows.__getitem__)
                    rows[ranks[name]] += B.batch_size(chunk)
            c = _Chunk(chunk, ranks, self._chunk_calls(chunk, ranks))
            for key, call in c.calls.items():  # watched as the synchronous loop's phases
                self.trainer.watchdog.track("values" if key.endswith("values") else "logprobs", call)
            waiting.update((f, c) for f in c.calls.values())
            calls.extend(c.calls.values())
            if not c.calls:
                train(c)

        def forwarded(f: Future) -> None:
            c = waiting.pop(f)
            f.result()  # a failed call raises here
            if not any(x in waiting for x in c.calls.values()):
                train(c)

        def train(c: _Chunk) -> None:  # its forward passes are in
            for key, call in c.calls.items():
                c.rows[key] = call.result()[0]
            self.algorithm.prepare_chunk(c.rows)
            chunks.append(c.rows)
            made = [self.trainer.watchdog.track(
                "train" if name == "policy" else "train_critic",
                step.group.train_microbatch(c.rows, c.dp_ranks[name]))
                for name, step in steps.items()]
            training.update(made)
            calls.extend(made)

        try:
            for step in steps.values():
                step.group.begin_train_step(step.loss_fn, need * n, step.micro_batch_size)
            while True:
                while self.ready and len(fed) < need:
                    sg = self.ready.popleft()
                    if version - sg.version > loop.max_staleness:
                        self.todo.append(sg.item)  # generated again with newer weights
                        self.dropped_stale += 1
                        continue
                    d = min(range(policy.dp_size), key=dp_rows["policy"].__getitem__)
                    buffers[d].append(sg)
                    fed.append(sg)
                    dp_rows["policy"][d] += n
                    if sum(B.batch_size(x.rows) for x in buffers[d]) >= mbs:
                        flush(d)
                if len(fed) == need:
                    for d in range(policy.dp_size):
                        if buffers[d]:
                            flush(d)
                self._dispatch(need - len(fed) + loop.max_staleness * need)
                clock.mark(bool(self.generating), bool(waiting or training))
                if len(fed) == need and not waiting and not training:
                    return fed, chunks
                # the canary of this step's weights, until its decoding is in
                canary = [c.decoding for c in [self.canary] if c is not None
                          and c.version == version and c.forward is None]
                done, _ = wait([*self.generating, *waiting, *training, *canary],
                               return_when=FIRST_COMPLETED)
                clock.mark(bool(self.generating), bool(waiting or training))
                for f in done:
                    if f in self.generating:
                        self._generated(f)
                    elif f in waiting:
                        forwarded(f)
                    elif f in training:
                        training.discard(f)
                        f.result()
                if canary and canary[0] in done:
                    if any(sg.version == version for sg in fed):
                        self.canary = None  # the step's own rows measure its weights
                    else:  # its forward beside the chunks', on the DP rank with fewest rows
                        self._forward_canary(min(range(policy.dp_size),
                                                 key=dp_rows["policy"].__getitem__))
        except BaseException as e:
            # Close the step on every rank once its calls are answered; its groups go back.
            wait([*waiting, *training])
            for step in steps.values():
                step.group.abort_train_step()
            self.ready.extendleft(reversed(fed))
            if isinstance(e, WorkerError):
                # Report the first call that failed, in the order they were made, not the first
                # answer read: a rank's later micro-batch fails only because the failure before
                # it closed that rank's step ("no split train step is open").
                e = next((f.exception() for f in calls
                          if f.done() and not f.cancelled()
                          and isinstance(f.exception(), WorkerError)), e)
                raise _Fault(str(e)) from e
            raise
