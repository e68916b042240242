"""The logprob contract's budget: trainer vs rollout logprobs, checked before and during a run.

The contract (``docs/logprob-contract.md``): every rollout backend returns, as
``generation_logprobs``, ``log_softmax(logits / generation.temperature)`` of the sampled token
in float32, before top-p; the trainer recomputes the same quantity from the policy
(``prev_logprobs``, :func:`mcore_rl.megatron.logprobs.vocab_parallel_logprobs`). Their gap
over the response tokens is summarized by :func:`mismatch_figures`; ``train/token_mult_prob_error``
is NeMo RL's multiplicative probability error, the mean of ``exp(|gap|)`` (1 when they agree).

:class:`LogprobBudget` holds ``generation.logprob_budget`` (the largest accepted
``token_mult_prob_error``; null: unchecked) and ``generation.logprob_budget_steps`` (k). The
start-up canary (:meth:`RLTrainer.logprob_canary <mcore_rl.controller.trainer.RLTrainer>`) over
budget refuses to train; k consecutive RL steps over budget stop the run, the k-th step aborted
before its optimizer step (a streamed step that trains no row decoded by its own weights is
measured on a canary decoded after the refit: :mod:`mcore_rl.controller.streaming`). Both
raise :class:`LogprobBudgetExceeded`, which exits the process with :data:`EXIT_CODE` (3): not
the input-error status 2 (the config is well-formed; the figure is a measurement of a backend,
precision and layout on given hardware) and not the preemption status 75 (a requeue would only
repeat the failure).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from mcore_rl.config.schema import TrainConfig

# Exit status of a run stopped by the logprob budget (start-up canary or k steps over budget).
EXIT_CODE = 3


class LogprobBudgetExceeded(SystemExit):
    """Trainer and rollout logprobs disagree beyond ``generation.logprob_budget``: the process
    exits with :data:`EXIT_CODE` unless a caller catches it. Nothing of the failing step was
    trained or saved.

    Attributes:
        message: one line naming the backend, precision, layout and the figures.
        figures: the :func:`mismatch_figures` of the failing batch.
        step: the RL step (1-based) that stopped the run; 0 for the start-up canary.
    """

    def __init__(self, message: str, figures: Dict[str, float], step: int):
        super().__init__(EXIT_CODE)
        self.message = message
        self.figures = figures
        self.step = step

    def __str__(self) -> str:
        return self.message


# The figures' names without their "train/" prefix (the loss's metrics with
# loss.prev_logprobs=train_forward), and the loss's count of the tokens they measured.
MISMATCH_KEYS = ("token_mult_prob_error", "logprob_mismatch_mean", "logprob_mismatch_max")
MISMATCH_TOKENS = "logprob_mismatch_tokens"


def mismatch_figures(rollout: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Trainer/rollout logprob gap over the response tokens of ``rollout``.

    Args:
        rollout: ``prev_logprobs`` and ``generation_logprobs`` [B, S] float32 (position ``t``:
            the logprob of token ``t``) and ``token_mask`` [B, S] (1 on response tokens).

    Returns:
        ``train/token_mult_prob_error``: mean over response tokens of ``exp(|gap|)`` (NeMo RL's
        definition; 1.0 without tokens); ``train/logprob_mismatch_mean`` and ``_max``: mean and
        max of ``|gap|`` (nats; 0.0 without tokens); ``gap = prev_logprobs - generation_logprobs``.
    """
    mask = rollout["token_mask"][:, 1:]
    mismatch = (rollout["prev_logprobs"] - rollout["generation_logprobs"]).abs()[:, 1:] * mask
    tokens = float(mask.sum())
    return {
        "train/logprob_mismatch_mean": float(mismatch.sum()) / tokens if tokens else 0.0,
        "train/token_mult_prob_error": float((mismatch.exp() * mask).sum()) / tokens if tokens else 1.0,
        "train/logprob_mismatch_max": float(mismatch.max()) if tokens else 0.0,
    }


def run_setup(cfg: TrainConfig) -> str:
    """What the mismatch depends on, as the error names it: ``generation.backend=megatron,
    policy.megatron.precision=bf16, layout TP=2 PP=1 DP=4``."""
    m = cfg.policy.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    dp = max(1, cfg.cluster.num_workers // (tp * pp))
    return (f"generation.backend={cfg.generation.backend}, policy.megatron.precision={m.precision}, "
            f"layout TP={tp} PP={pp} DP={dp}")


def _figures_text(f: Dict[str, float]) -> str:
    return (f"train/token_mult_prob_error {f['train/token_mult_prob_error']:.4f}, |gap| mean "
            f"{f['train/logprob_mismatch_mean']:.4f} max {f['train/logprob_mismatch_max']:.4f}")


class LogprobBudget:
    """``generation.logprob_budget`` and ``logprob_budget_steps`` of a run, and the count of
    consecutive RL steps over budget.

    Args:
        cfg: the run's config (``generation.*``, and what :func:`run_setup` names).

    Attributes:
        budget: the largest accepted ``train/token_mult_prob_error``; None: nothing is checked.
        steps: k, the consecutive over-budget steps that stop the run.
        over: consecutive RL steps over budget so far (0 after a step within it).
    """

    def __init__(self, cfg: TrainConfig):
        self.budget: Optional[float] = cfg.generation.logprob_budget
        self.steps = cfg.generation.logprob_budget_steps
        self.setup = run_setup(cfg)
        self.over = 0

    def _exceeds(self, figures: Dict[str, float]) -> bool:
        return self.budget is not None and figures["train/token_mult_prob_error"] > self.budget

    def check_canary(self, figures: Dict[str, float], prompts: int) -> None:
        """The start-up canary's figures (``prompts`` prompts) against the budget.

        Raises:
            LogprobBudgetExceeded: over budget (``step`` 0).
        """
        if self._exceeds(figures):
            raise LogprobBudgetExceeded(
                f"logprob budget exceeded at start-up, before the first RL step: "
                f"{_figures_text(figures)} > generation.logprob_budget={self.budget:g} on a canary "
                f"of {prompts} prompts with {self.setup}; the rollout engine does not sample the "
                f"distribution the trainer scores (see docs/logprob-contract.md; raise "
                f"generation.logprob_budget or set it to null to train anyway)", figures, 0)

    def observe(self, step: int, figures: Dict[str, float], trained: bool = False,
                canary: int = 0) -> None:
        """Count RL step ``step`` (1-based), whose trainer logprobs are in, before its optimizer
        step (``trained``: after it, the figures measured by the training forward with
        ``loss.prev_logprobs=train_forward``): over budget extends the run of consecutive
        over-budget steps, within resets it. ``canary``: the figures are those of a canary of
        that many prompts decoded by the weights being trained (the streaming loop's, for a
        step whose rows were all decoded by older weights; the error says so); 0: of the
        step's own rows.

        Raises:
            LogprobBudgetExceeded: the ``steps``-th consecutive step over budget; the caller
                aborts the open step (nothing of it trained or saved).
        """
        if not self._exceeds(figures):
            self.over = 0
            return
        self.over += 1
        if self.over >= self.steps:
            raise LogprobBudgetExceeded(
                f"logprob budget exceeded for {self.over} consecutive RL steps "
                f"(generation.logprob_budget_steps={self.steps}): RL step {step} has "
                f"{_figures_text(figures)} > generation.logprob_budget={self.budget:g} with "
                f"{self.setup}" + (
                    f" on a canary of {canary} prompts decoded after the refit (every row of "
                    f"step {step} was decoded by older weights)" if canary else "") + "; " + (
                    f"step {step}'s update (loss.prev_logprobs=train_forward measures in the "
                    f"training forward) is in memory only: nothing of step {step} was saved"
                    if trained else
                    f"step {step} was aborted before its optimizer step (the parameters are "
                    f"those after RL step {step - 1}; nothing of step {step} was saved)"),
                figures, step)

    def observe_trained(self, step: int, metrics: Dict[str, float]) -> None:
        """``loss.prev_logprobs=train_forward``: :meth:`observe` (``trained``) of RL step
        ``step`` (1-based) with the figures its training forward measured, after its optimizer
        step: the policy update's metrics ``metrics`` (``train/<name>`` of
        :data:`MISMATCH_KEYS`, over ``train/`` :data:`MISMATCH_TOKENS` tokens). A step that
        measured no token (a streamed step whose rows were all decoded by older weights) is not
        counted here (the streaming loop counted the refit's canary for it before the update,
        where it had one), and its figures (0 over 0 tokens) are removed from ``metrics``.

        Raises:
            KeyError: ``metrics`` lacks a figure (the loss was not built with
                ``loss.prev_logprobs=train_forward``).
            LogprobBudgetExceeded: as :meth:`observe`; the step has trained, in memory.
        """
        figures = {f"train/{k}": metrics[f"train/{k}"] for k in MISMATCH_KEYS}
        if not metrics[f"train/{MISMATCH_TOKENS}"]:
            for k in figures:
                del metrics[k]
            return
        self.observe(step, figures, trained=True)
