"""`make demo`: train the built-in GPT-style model a few steps with ckpt and
with torch.compile's default, and print memory, speed and gradient agreement."""
from bench.compare import compare, format_table


def main() -> None:
    print("Compiling and training the GPT-style decoder (6 layers, d=256, seq 256, batch 4)")
    print("with eager PyTorch, torch.compile's default, and ckpt_backend ...\n")
    print(format_table("gpt", compare("gpt", repeats=5)))
    print(
        "\nsaved MiB: bytes autograd keeps for backward (saved_tensors_hooks, each storage once,"
        "\nparameters and inputs excluded); peak MiB: peak allocated during one training step"
        "\n(profiler memory events); max grad diff: largest |grad - eager grad|."
    )


if __name__ == "__main__":
    main()
