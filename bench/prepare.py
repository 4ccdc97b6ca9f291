"""`dataset prepare` at corpus scale: MB/s and peak memory of preparing a synthetic JSONL
corpus (~1.5 GB by default) with 1 and 2 worker processes.

    .venv/bin/python bench/prepare.py [--gb 1.5] [--bpe-gb 0.15] [--workers 1 2] [--keep]

The corpus (``{"id": n, "text": ...}`` lines, English-like words, documents of 200 B to
8 KB, deterministic) is written to a temp dir, prepared once per worker count in a fresh
process (``prepare_dataset(..., workers=N)``), and deleted at the end with the versions.
Two suites: the bytes tokenizer on ``--gb`` (reading, JSON parsing, writing and hashing are
the work), and a 32k byte-level BPE (a tokenizers JSON trained on the corpus's texts first)
on a smaller ``--bpe-gb`` corpus (tokenizing is the work). Measured per run:

* wall seconds and MB/s of source read (MB = 10**6 bytes of the JSONL);
* CPU seconds of the whole process tree (the prepare process and its workers, from
  ``getrusage(RUSAGE_CHILDREN)``) and MB per CPU-second: what one fully used core
  prepares, the figure that does not depend on how busy the machine is;
* peak RSS of the process tree (the sum over the prepare process and its workers, sampled
  every 50 ms from /proc) and of the prepare process alone.

Results in ``bench/results/prepare.json``. The versions must be byte-identical across worker
counts (checked: content_sha256).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
WORDS = (
    "the of and to in is was that for it with as on be by at this had not are but from or have an they which one "
    "you were all her she there would their we him been has when who will no more if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three data model training token gradient tensor parallel checkpoint batch"
).split()


def write_corpus(path: Path, target_bytes: int) -> tuple[int, int]:
    """JSONL of ~``target_bytes``: 4,096 distinct documents cycled with a new id each. ->
    (bytes, documents)."""
    rng = random.Random(27)
    texts = []
    for _ in range(4096):
        n = int(rng.lognormvariate(6.5, 0.8)) + 30  # words: median ~700, a long tail
        words = rng.choices(WORDS, k=min(n, 1400))
        texts.append(" ".join(words).capitalize() + ".")
    written = documents = 0
    with open(path, "w", buffering=8 << 20) as f:
        while written < target_bytes:
            line = json.dumps({"id": documents, "text": texts[documents % len(texts)]}) + "\n"
            f.write(line)
            written += len(line)
            documents += 1
    return path.stat().st_size, documents


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of ``pid`` and all its descendants, RSS of ``pid`` alone), bytes."""

    def rss(p: int) -> int:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def children(p: int) -> list[int]:
        out = []
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
        return out

    own, total, todo = rss(pid), 0, [pid]
    while todo:
        p = todo.pop()
        total += rss(p)
        todo += children(p)
    return total, own


RUN = """
import json, resource, sys
from pathlib import Path
from services.data.prepare import prepare_dataset
info = prepare_dataset(Path(sys.argv[1]), "bench", sys.argv[2], Path(sys.argv[3]), tokenizer=sys.argv[4],
                       include_glob=None, workers=int(sys.argv[5]))
print(json.dumps({"seconds": info.seconds, "documents": info.train_documents + info.val_documents,
                  "tokens": info.train_tokens + info.val_tokens, "source_bytes": info.source_bytes,
                  "workers": info.workers, "content_sha256": info.content_sha256,
                  "cpu_main": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
                  "cpu_workers": sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])}))
"""


def run(corpus: Path, root: Path, workers: int, tokenizer: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # One process is one core: without this, tokenizers would spread the in-process (workers 1)
    # BPE run over every core, and "MB/s per process" would not be one process's.
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-c", RUN, str(corpus), f"w{workers}", str(root), tokenizer, str(workers)]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, text=True)
    peak_tree = peak_main = 0
    while proc.poll() is None:
        tree, own = tree_rss(proc.pid)
        peak_tree, peak_main = max(peak_tree, tree), max(peak_main, own)
        time.sleep(0.05)
    wall = time.monotonic() - t0
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"prepare with {workers} worker(s) failed (exit {proc.returncode})")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(out.strip().splitlines()[-1])
    mb = result["source_bytes"] / 1e6
    shutil.rmtree(root / "bench" / f"w{workers}")
    return {
        "workers": workers,
        "workers_used": result["workers"],
        "wall_seconds": round(wall, 2),
        "prepare_seconds": round(result["seconds"], 2),
        "mb_per_s": round(mb / result["seconds"], 1),
        "cpu_seconds": round(cpu, 2),
        "mb_per_cpu_second": round(mb / cpu, 1),
        "cpu_seconds_main": round(result["cpu_main"], 2),  # reading, collecting, writing, hashing
        "cpu_seconds_workers": round(result["cpu_workers"], 2),  # parsing and tokenizing (0: in the main process)
        "peak_rss_tree_mib": round(peak_tree / 2**20, 1),
        "peak_rss_main_mib": round(peak_main / 2**20, 1),
        "documents": result["documents"],
        "tokens": result["tokens"],
        "content_sha256": result["content_sha256"],
    }


def bpe_tokenizer(work: Path, vocab: int) -> Path:
    """A byte-level BPE of ``vocab`` tokens (services/data/bpe.py) trained on the corpus's
    distinct texts, saved as a tokenizers JSON: the kind of tokenizer a pretraining corpus is
    prepared with, where tokenizing (not reading) is the work."""
    from services.data.bpe import train_bpe

    rng = random.Random(27)
    path = work / f"bpe{vocab}.json"
    corpus = work / "sample.jsonl"
    write_corpus(corpus, 8_000_000)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    rng.shuffle(texts)
    path.write_text(train_bpe(texts, vocab))
    corpus.unlink()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.5, help="corpus size for the bytes tokenizer, 10**9 bytes")
    ap.add_argument("--bpe-gb", type=float, default=0.15, help="corpus size for the BPE tokenizer (0: skip)")
    ap.add_argument("--bpe-vocab", type=int, default=32768)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dir", type=Path, default=None, help="where the corpus and versions go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and its directory")
    ap.add_argument("--out", type=Path, default=RESULTS / "prepare.json")
    args = ap.parse_args()

    work = Path(args.dir or tempfile.mkdtemp(prefix="surge-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    suites = [("bytes", args.gb)] + ([(f"bpe:{args.bpe_vocab}", args.bpe_gb)] if args.bpe_gb > 0 else [])
    doc = {
        "bench": "prepare",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "host": {
            "cpus": os.cpu_count(),
            "load_average_at_start": [round(x, 1) for x in os.getloadavg()],
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "suites": [],
        "unix": int(time.time()),
    }
    try:
        for tokenizer, gb in suites:
            corpus = work / f"corpus-{gb}.jsonl"
            t0 = time.monotonic()
            size, documents = write_corpus(corpus, int(gb * 1e9))
            print(f"corpus: {size / 1e6:,.0f} MB, {documents:,} documents, written in {time.monotonic() - t0:.0f} s")
            spec = "bytes" if tokenizer == "bytes" else str(bpe_tokenizer(work, args.bpe_vocab))
            runs = []
            for n in args.workers:
                r = run(corpus, work / "datasets", n, spec)
                print(
                    f"{tokenizer}, workers {n}: {r['mb_per_s']} MB/s ({r['prepare_seconds']} s), "
                    f"{r['mb_per_cpu_second']} MB per CPU-second (main {r['cpu_seconds_main']} s, workers "
                    f"{r['cpu_seconds_workers']} s), peak RSS {r['peak_rss_tree_mib']} MiB (prepare process "
                    f"{r['peak_rss_main_mib']} MiB)"
                )
                runs.append(r)
            if len({r["content_sha256"] for r in runs}) != 1:
                raise SystemExit(f"{tokenizer}: versions differ across worker counts")
            if not args.keep:
                corpus.unlink()
            doc["suites"].append(
                {
                    "tokenizer": tokenizer
                    if tokenizer == "bytes"
                    else f"{tokenizer} (a tokenizers JSON trained first)",
                    "corpus": {"format": "jsonl", "mb": round(size / 1e6, 1), "documents": documents},
                    "runs": runs,
                }
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
