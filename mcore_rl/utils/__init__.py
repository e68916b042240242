"""mcore-rl: utils."""
