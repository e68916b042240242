"""mcore-rl: controller."""
