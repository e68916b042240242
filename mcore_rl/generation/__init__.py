"""mcore-rl: generation."""
