"""mcore-rl: generation (rollout) backends behind one interface, refit from the policy."""

from mcore_rl.generation.base import GenerationBackend, get_backend

__all__ = ["GenerationBackend", "get_backend"]
