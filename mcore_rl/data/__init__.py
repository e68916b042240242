"""mcore-rl: data."""
