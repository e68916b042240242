"""mcore-rl: PPO/GRPO post-training of LLMs on Megatron-Core."""

__version__ = "0.1.0"
