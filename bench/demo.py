"""`make demo`: train the built-in GPT-style model a few steps with ckpt and
with torch.compile's default, and print memory, speed and gradient agreement;
two budget rows show the lever: the tightest fraction, and a cap on the
step's peak between the two."""
from bench.compare import compare, format_table

MODES = ("eager", "compile", "ckpt", "ckpt+budget=0.0", "ckpt+budget=peak:48MiB")


def main() -> None:
    print("Compiling and training the GPT-style decoder (6 layers, d=256, seq 256, batch 4)")
    print("with eager PyTorch, torch.compile's default, and ckpt_backend without and with a budget ...\n")
    print(format_table("gpt", compare("gpt", modes=MODES, repeats=5)))
    print(
        "\nsaved MiB: bytes autograd keeps for backward (saved_tensors_hooks, each storage once,"
        "\nparameters and inputs excluded); peak MiB: peak allocated during one training step"
        "\n(profiler memory events); max grad diff: largest |grad - eager grad|."
        "\nckpt+budget=0.0: recompute all that pays to (CKPT_MEMORY_BUDGET=0.0); "
        "ckpt+budget=peak:48MiB: the fastest plan"
        "\nwhose step peak fits 48 MiB (CKPT_MEMORY_BUDGET=peak:48MiB). Budgets trade step time for memory."
    )


if __name__ == "__main__":
    main()
