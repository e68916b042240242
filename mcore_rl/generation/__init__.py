"""mcore-rl: generation (rollout) backends behind one interface (:mod:`.base`), each with its
refit channel, found by name in :mod:`.registry`. Imports nothing: the config loader reads the
registry without torch."""
