"""mcore-rl: workers."""
