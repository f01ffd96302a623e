"""Memory proved: with ``storage: auto`` (the default), a 64 MB corpus on a token cache hit trains in
at most 100 MiB of peak RSS more than the same steps on a tiny generated corpus.

One subprocess measures both, the tiny baseline first: peak RSS is ``VmHWM`` from
``/proc/self/status``, reset to the current RSS by writing 5 to ``/proc/self/clear_refs`` before
each phase (``tracemalloc`` cannot see tensor storage, CUDA counters read 0 on CPU:
docs/platform.md#the-cuda-memory-counters-read-0-on-a-cpu). The cache entry is built by the test
process beforehand, so the measured run is a hit, as every rank but one and every later run of a
study is.

Seen failing with the mechanism broken: ``AUTO_CACHE_BYTES`` raised above the corpus (``auto``
keeps the 64 MB in memory): the large phase peaked 2347 MiB above the baseline.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lit_ablate.data import LMDataModule, LocalFiles, SyntheticText

CORPUS_BYTES = 64 * 10**6
ALLOWED_MIB = 100
STEPS = 5

_MEASURE = r"""
import json, sys
import lightning as L
from lit_ablate.data import LMDataModule, LocalFiles, SyntheticText
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM

def peak_mib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def fit(source, steps):
    L.seed_everything(0)
    dm = LMDataModule(source, seq_len=64, batch_size=4, cache_dir=sys.argv[2])
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0), datamodule=dm)
    return dm.setup_record

fit(SyntheticText(num_documents=50), 1)  # first use: lazy imports, allocator pools
reset_peak()
tiny = fit(SyntheticText(num_documents=200), int(sys.argv[3]))
baseline = peak_mib()
reset_peak()
large = fit(LocalFiles(sys.argv[1]), int(sys.argv[3]))
print(json.dumps({"baseline_mib": baseline, "large_mib": peak_mib(), "tiny": tiny, "large": large}))
"""


def write_corpus(path: Path, size: int) -> int:
    """A JSONL corpus of at least ``size`` bytes: a block of ~1 MB of distinct documents from
    ``SyntheticText``'s grammar, written again and again (fast: ~0.1 s per 64 MB)."""
    rng = random.Random(0)
    sentences = [row["text"] for row in SyntheticText(num_documents=500, median_sentences=1, length_sigma=0)]
    lines, block_bytes = [], 0
    while block_bytes < 2**20:
        line = json.dumps({"text": " ".join(rng.choices(sentences, k=rng.randint(3, 60)))}) + "\n"
        lines.append(line)
        block_bytes += len(line)
    block = "".join(lines).encode()
    with open(path, "wb") as f:
        for _ in range(-(-size // len(block))):
            f.write(block)
    return path.stat().st_size


@pytest.mark.slow
def test_a_large_corpus_on_a_cache_hit_trains_in_bounded_memory(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    assert write_corpus(corpus, CORPUS_BYTES) >= CORPUS_BYTES
    cache = str(tmp_path / "cache")
    LMDataModule(LocalFiles(str(corpus)), seq_len=64, batch_size=4, cache_dir=cache).setup()  # the build
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(corpus), cache, str(STEPS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    grown = result["large_mib"] - result["baseline_mib"]
    print(f"peak RSS: tiny baseline {result['baseline_mib']:.0f} MiB, 64 MB corpus {result['large_mib']:.0f} MiB")
    assert grown <= ALLOWED_MIB, f"peak RSS grew {grown:.0f} MiB over the tiny baseline (allowed {ALLOWED_MIB})"
    assert result["tiny"]["storage"] == "memory" and result["large"]["storage"] == "cache"
    assert result["large"]["cache_hit"] is True and result["large"]["storage_requested"] == "auto"
