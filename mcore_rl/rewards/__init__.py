"""mcore-rl: rewards."""
