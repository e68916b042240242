"""mcore-rl: algorithms."""
