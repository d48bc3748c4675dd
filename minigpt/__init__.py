"""minigpt: a GPT-2 inference engine written from scratch in PyTorch."""
