"""Peak memory per rank under torch.distributed (2 processes, gloo, CPU):
ckpt vs torch.compile's default, for tensor parallelism and FSDP2.

    python -m bench.distributed
"""
from __future__ import annotations

import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.measure import count_saved_bytes, peak_cpu_bytes
from bench.models import GPT, TPMLP, GPTConfig, gpt_batch, tp_mlp_plan
from ckpt import make_backend

WORLD = 2
MiB = 2**20
GPT_CONFIG = GPTConfig(depth=4, width=256, heads=8, seq=256, vocab=1024)


def _tp_mlp(mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = TPMLP(width=512, hidden=2048)
    parallelize_module(model, mesh, tp_mlp_plan())
    return model


def _fsdp_gpt(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# (name, build(mesh) -> sharded model, inputs): built afresh for each mode
# from the same seed (FSDP2 modules cannot be deep-copied).
CASES = (
    ("tensor parallel MLP (512 -> 2048, batch 2048)", _tp_mlp, lambda: (torch.randn(2048, 512),)),
    ("FSDP2 GPT-style (4 layers, d=256, seq 256, batch 4)", _fsdp_gpt, lambda: gpt_batch(GPT_CONFIG, 4)),
)


def _worker(rank, port, out):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = []
    for name, build, make_inputs in CASES:
        for mode in ("compile", "ckpt"):
            torch._dynamo.reset()
            model, inputs = build(mesh), make_inputs()
            fn = torch.compile(model) if mode == "compile" else torch.compile(model, backend=make_backend())

            def step(model=model, fn=fn):
                model.zero_grad(set_to_none=True)
                fn(*inputs).backward()

            step()  # compile
            with count_saved_bytes(list(model.parameters()) + list(inputs)) as saved:
                loss = fn(*inputs)
            loss.backward()
            model.zero_grad(set_to_none=True)  # the peak counts from parameters and inputs alone
            rows.append([name, mode, rank, saved["bytes"], peak_cpu_bytes(step)])
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, out), nprocs=WORLD)
        rows = [row for rank in range(WORLD) for row in json.load(open(os.path.join(out, f"{rank}.json")))]
    print(f"torch {torch.__version__}, {WORLD} ranks (gloo, CPU, 1 thread each)")
    print("| model | mode | rank | saved MiB | peak MiB |")
    print("|---|---|---|---|---|")
    for name, mode, rank, saved, peak in sorted(rows, key=lambda r: (r[0], r[2], r[1])):
        print(f"| {name} | {mode} | {rank} | {saved / MiB:.1f} | {peak / MiB:.1f} |")


if __name__ == "__main__":
    main()
