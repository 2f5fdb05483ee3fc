"""Built-in models and measurement helpers for comparing ckpt with torch.compile."""
