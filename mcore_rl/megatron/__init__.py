"""mcore-rl: megatron."""
