"""mcore-rl: config."""
