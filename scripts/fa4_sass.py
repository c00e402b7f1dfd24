"""flash-attn-4's sm90 backward compiled on a machine without a GPU (developer tool), to read its
SASS beside ours: the consumer loop's instruction mix and the order of its waits, barriers and
smem stores (how `BwdSm90Config.mask_always` was found, docs/notes.md session 17).

    tar xJf .devsite/site.tar.xz -C /tmp/fa4site flash_attn quack einops   # once
    python scripts/fa4_sass.py --site /tmp/fa4site --hdim 192 --causal 1 --out /tmp/fa4_192c.sass

Works through flash-attn-4's own CPU-compile switches (FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH) and
torch's FakeTensorMode. quack's autotuner (imported by quack's package, never called here) needs
triton, which is not installed on the CPU machine: it is replaced by a stub module. The cubins
land in a temporary dump directory; the main kernel's SASS is written to --out.
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import types


def stub_quack_autotuner() -> None:
    stub = types.ModuleType("quack.autotuner")
    stub.autotune = lambda *a, **k: (lambda f: f)

    class AutotuneConfig:
        def __init__(self, *a, **k) -> None:
            self.kwargs = k

    stub.AutotuneConfig = AutotuneConfig
    sys.modules["quack.autotuner"] = stub


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", default="/tmp/fa4site", help="folder holding flash_attn, quack, einops")
    ap.add_argument("--hdim", type=int, default=192)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--out", default="fa4_bwd.sass")
    args = ap.parse_args()
    dump = tempfile.mkdtemp(prefix="fa4_dump_")
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                      CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=dump)
    sys.path.insert(0, args.site)
    stub_quack_autotuner()
    import torch
    from flash_attn.cute import interface
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cute_flash import inspect as ins

    d, n = args.hdim, args.seqlen
    b, h = max(1, 16384 // n), 2048 // d
    with FakeTensorMode():
        q, k, v, do = (torch.empty(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
        interface._flash_attn_bwd(q, k, v, torch.empty_like(q), do, lse, causal=bool(args.causal))
    (cubin,) = glob.glob(os.path.join(dump, "*bwd_sm90*.cubin"))
    tools = ins.tools_dir()
    if tools is None:
        sys.exit(f"no cuobjdump found; the cubin is {cubin}")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    with open(args.out, "w") as f:
        f.write(sass)
    print(f"{args.out}: {sass.count(chr(10))} lines (cubin {cubin})")


if __name__ == "__main__":
    main()
