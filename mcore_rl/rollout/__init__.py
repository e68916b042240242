"""Rollouts (floor 6, beside :mod:`mcore_rl.environments`): the multi-turn rollout loop
(:mod:`~mcore_rl.rollout.multi_turn`) and the producer the RL loops take their rollouts from
(:mod:`~mcore_rl.rollout.producer`). See ``docs/design.md``, "Rollout floor"."""
