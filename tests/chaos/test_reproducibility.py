"""Chaos finding: the adapter a run publishes depends on which gpu worker *process* trained it.

Found by the worker-kill cases: after a gpu worker is replaced, the retrained adapter's weights are
bit-identical to the reference run's but ``adapter_config.json`` (and so the adapter digest) is
not, because PEFT keeps ``target_modules`` as a set and writes it in the process's hash order.
The other chaos cases therefore run every worker with ``PYTHONHASHSEED=0``; this test shows the
bug directly with two processes that differ only in their hash seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.chaos.assertions import expect_fixed
from tests.support.chaos.stack import REPO_ROOT

SCRIPT = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from kiln.core.train.model import attach_lora, load_base_model, save_adapter
model = attach_lora(load_base_model(Path(sys.argv[1]), torch.device("cpu")), rank=4, alpha=8, seed=0,
                    base_adapter_dir=None)
out = Path(sys.argv[2])
digest = save_adapter(model, out)
config = json.loads((out / "adapter_config.json").read_text())
weights = (out / "adapter_model.safetensors").read_bytes()
import hashlib
print(json.dumps({"adapter_sha256": digest, "target_modules": config["target_modules"],
                  "weights_sha256": hashlib.sha256(weights).hexdigest()}))
"""


def test_adapter_bytes_do_not_depend_on_the_worker_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()}
    env.update({"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(tmp_path / f"adapter-{seed}")],
            env={**env, "PYTHONHASHSEED": str(seed)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=REPO_ROOT,
        )
        for seed in (1, 2)  # two hash seeds whose set orders of the 7 LoRA targets differ
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
        outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
    one, two = outputs
    assert one["weights_sha256"] == two["weights_sha256"]  # the weights are reproducible
    assert sorted(one["target_modules"]) == sorted(two["target_modules"])
    expect_fixed(
        one["adapter_sha256"] == two["adapter_sha256"],
        f"adapter digest differs between processes: target_modules {one['target_modules']} vs "
        f"{two['target_modules']}",
    )
