"""The prefix cache's disk tier across processes (issue 37, acceptance 1 and 5). Every run is a
process of its own, started afresh, so nothing survives in RAM between them:

- A / B, alternated (A/B/A/B...): a cold --prompt-tokens prompt, greedy --max-tokens tokens, with
  kv_cache_disk_gb=0 (A) and with the disk tier on an empty folder (B, which writes every block):
  time to first token and decode speed, which the tier must leave within noise.
- warm: a new process on the folder the last B run left sends the prompt plus a question: its
  blocks are read from disk, only the question is computed.
- cold reference: the prompt plus the question with kv_cache_disk_gb=0: the time to beat (>= 5x)
  and the greedy tokens the warm run must repeat.
- warm in RAM: one process without the tier sends the prompt, then the prompt plus the question
  (the RAM prefix cache's reuse): the warm run from disk must give exactly its tokens, since the
  pages it reads are the pages that process computed. (Where reuse itself moves a near tie, as the
  `auto` path's rounding may when the tail is computed alone, this tells the tier from the reuse.)

With --sessions, the same through the server's saved sessions instead (acceptance 4; the disk tier
off): one server process saves the document (`POST /sessions/doc/save`) and exits; a new one restores
it (`POST /sessions/doc/restore`) and streams the document plus the question; a third streams it
cold. TTFT is the time to the first streamed chunk, as a client sees it.

    python benchmarks/prefix_disk.py                          # SmolLM2, the embedded default
    python benchmarks/prefix_disk.py --sessions
    python benchmarks/prefix_disk.py --model qwen2.5-coder-1.5b --json benchmarks/results/prefix_disk_qwen1.5b.json
    python benchmarks/prefix_disk.py --model ~/hybrid-models/granite-4.0-h-1b-q8_0.gguf   # a hybrid (issue 51 item 2)

A recurrent or hybrid model (benchmarks/hybrid_models.py writes real shapes) runs the same: its
state checkpoints are written and read beside its blocks, so the warm run skips its recurrent layers too.

The folders are temporary (never ~/.cache). Results: --json (default benchmarks/results/prefix_disk_<model>.json).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
QUESTION = "\n\nQuestion: in one sentence, what is the text above about?\nAnswer:"
DISK_GB = 4.0


def one_process(args: argparse.Namespace) -> None:
    """--role run: load, send one prompt, print one JSON line."""
    from wallbreaker import LLM, SamplingParams
    from wallbreaker.measure.workload import prompt_ids
    start = time.perf_counter()
    options = {"kv_cache_disk_gb": args.disk_gb}
    if args.disk_dir:
        options["kv_cache_disk_dir"] = args.disk_dir
    llm = LLM(args.model, dtype=args.dtype, batch_invariant=args.batch_invariant, **options)
    load_s = time.perf_counter() - start
    ids = prompt_ids(llm.tokenizer, args.prompt_tokens, "prefix disk benchmark document")
    if args.warm_in_ram:  # the prompt alone first, so that the question's run reuses it from RAM
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    if args.question or args.warm_in_ram:
        ids = ids + llm.tokenizer.encode(QUESTION, add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                                 ignore_eos=True, logprobs=5))[0]
    flush_start = time.perf_counter()
    llm.shutdown()  # the disk tier's queued writes, as at the end of any process
    stats = llm.stats()
    print(json.dumps({"ttft_s": out.metrics["ttft_s"], "decode_tokens_per_s": out.metrics["decode_tokens_per_s"],
                      "prompt_tokens": len(ids), "cached_prompt_tokens": out.metrics["num_cached_prompt_tokens"],
                      "token_ids": out.outputs[0].token_ids, "load_s": load_s,
                      "top_logprobs": out.outputs[0].top_logprobs,
                      "flush_s": time.perf_counter() - flush_start,
                      "disk": {k: v for k, v in stats.items() if k.startswith("kv_disk_")}}))


def one_server_process(args: argparse.Namespace) -> None:
    """--role server: a real server (uvicorn, in a thread) on the session folder; save, or (restore
    and) stream one turn; print one JSON line."""
    import socket
    import threading

    import httpx
    import uvicorn

    from wallbreaker import LLM
    from wallbreaker.measure.workload import prompt_ids
    from wallbreaker.server.app import build_app
    from wallbreaker.server.run import uvicorn_config
    llm = LLM(args.model, dtype=args.dtype, kv_cache_disk_dir=args.disk_dir)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(build_app(llm, port=port), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    doc = prompt_ids(llm.tokenizer, args.prompt_tokens, "prefix disk benchmark document")
    turn = doc + llm.tokenizer.encode(QUESTION, add_special_tokens=False)
    result: dict = {}
    if args.session == "save":
        start = time.perf_counter()
        r = httpx.post(f"{url}/sessions/doc/save", json={"prompt": doc}, timeout=900)
        result = {"status": r.status_code, "save_s": time.perf_counter() - start, **r.json()}
    else:
        if args.session == "restore":
            start = time.perf_counter()
            r = httpx.post(f"{url}/sessions/doc/restore", json={}, timeout=900)
            result = {"status": r.status_code, "restore_s": time.perf_counter() - start,
                      "restored_tokens": r.json().get("num_tokens")}
        body = {"prompt": turn, "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        text, first = "", None
        start = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        first = first if first is not None else time.perf_counter() - start
                        text += chunk["choices"][0]["text"]
        result.update(ttft_s=first, text=text)
    server.should_exit = True
    thread.join(30)
    print(json.dumps(result))


def sessions_main(args: argparse.Namespace) -> None:
    from wallbreaker.measure.machine import describe_machine, machine_facts
    from wallbreaker.measure.reporting import write_json
    facts = machine_facts()
    root = Path(tempfile.mkdtemp(prefix="wb-sessions-"))

    def server(session: str, folder: Path) -> dict:
        cmd = [sys.executable, __file__, "--role", "server", "--session", session, "--model", args.model or "",
               "--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens), "--max-tokens",
               str(args.max_tokens), "--disk-dir", str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"a server run failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    try:
        saved = server("save", root / "shared")
        warm = server("restore", root / "shared")
        cold = server("cold", root / "empty")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"model": args.model or "smollm2 (embedded default)", "dtype": args.dtype, "machine": facts,
              "prompt_tokens": args.prompt_tokens, "saved": saved, "warm": warm, "cold": cold,
              "speedup": cold["ttft_s"] / warm["ttft_s"],
              "speedup_with_restore": cold["ttft_s"] / (warm["ttft_s"] + warm["restore_s"]),
              "same_text": warm["text"] == cold["text"]}
    name = (args.model or "smollm2").removesuffix(".gguf").rsplit("/", 1)[-1].lower()
    path = write_json(args.json or RESULTS / f"prefix_sessions_{name}.json", result)
    print(f"{describe_machine(facts)}\n{result['model']}, {args.dtype}: saved {saved['num_tokens']} tokens "
          f"({saved['bytes'] / 1e6:.0f} MB) in {saved['save_s']:.2f} s; new server: restore {warm['restore_s']:.3f} s, "
          f"next turn TTFT {warm['ttft_s']:.3f} s against {cold['ttft_s']:.2f} s cold ({result['speedup']:.1f}x; "
          f"{result['speedup_with_restore']:.1f}x counting the restore), same text: {result['same_text']}; {path}")


def spawn(args: argparse.Namespace, disk_gb: float, folder: Path | None, question: bool, warm_in_ram: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--role", "run", "--model", args.model or "", "--dtype", args.dtype,
           "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
           "--disk-gb", str(disk_gb)] + (["--disk-dir", str(folder)] if folder else []) + \
        (["--question"] if question else []) + (["--warm-in-ram"] if warm_in_ram else []) + \
        (["--batch-invariant"] if args.batch_invariant else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"a run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("main", "run", "server"), default="main")
    ap.add_argument("--sessions", action="store_true", help="measure saved sessions through the server")
    ap.add_argument("--session", choices=("save", "restore", "cold"), default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ab-runs", type=int, default=2, help="A/B pairs (each a cold prompt)")
    ap.add_argument("--disk-gb", type=float, default=0.0)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--question", action="store_true")
    ap.add_argument("--warm-in-ram", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="every run in batch-invariant mode: the warm run must give the cold run's logits bit for bit")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.model == "":
        args.model = None
    if args.role == "run":
        one_process(args)
        return
    if args.role == "server":
        one_server_process(args)
        return
    if args.sessions:
        sessions_main(args)
        return
    from wallbreaker.measure.machine import describe_machine, machine_facts
    facts = machine_facts()
    root = Path(tempfile.mkdtemp(prefix="wb-prefix-disk-"))
    try:
        a_runs, b_runs = [], []
        folder = None
        for i in range(args.ab_runs):
            a_runs.append(spawn(args, 0.0, None, False))
            folder = root / f"b{i}"
            b_runs.append(spawn(args, DISK_GB, folder, False))
            print(f"A {a_runs[-1]['ttft_s']:.2f} s / {a_runs[-1]['decode_tokens_per_s']:.1f} tok/s   "
                  f"B {b_runs[-1]['ttft_s']:.2f} s / {b_runs[-1]['decode_tokens_per_s']:.1f} tok/s "
                  f"({b_runs[-1]['disk']['kv_disk_bytes_written'] / 1e6:.0f} MB written)", flush=True)
        warm = spawn(args, DISK_GB, folder, True)
        cold = spawn(args, 0.0, None, True)
        ram = spawn(args, 0.0, None, False, warm_in_ram=True)
        disk_mb = sum(p.stat().st_size for p in (folder / "blocks").iterdir() if p.suffix in (".kvb", ".kvst")) / 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    result = {
        "model": args.model or "smollm2 (embedded default)", "dtype": args.dtype, "machine": facts,
        "prompt_tokens": args.prompt_tokens, "question_prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_s": cold["ttft_s"], "warm_ttft_s": warm["ttft_s"], "speedup": cold["ttft_s"] / warm["ttft_s"],
        "warm_cached_prompt_tokens": warm["cached_prompt_tokens"], "warm_disk": warm["disk"],
        "batch_invariant": args.batch_invariant,
        "same_greedy_tokens": warm["token_ids"] == cold["token_ids"],
        # every step's top-5 log-probabilities, compared as floats: equal only where the logits are
        "same_top_logprobs": warm["top_logprobs"] == cold["top_logprobs"],
        "first_differing_token": next((i for i, (a, b) in enumerate(zip(warm["token_ids"], cold["token_ids"]))
                                       if a != b), None),
        "ram_warm_ttft_s": ram["ttft_s"], "same_greedy_tokens_as_ram_warm": warm["token_ids"] == ram["token_ids"],
        "disk_folder_mb": disk_mb,
        "ab": {"A_disk_off_ttft_s": med(a_runs, "ttft_s"), "B_disk_on_ttft_s": med(b_runs, "ttft_s"),
               "A_disk_off_decode_tokens_per_s": med(a_runs, "decode_tokens_per_s"),
               "B_disk_on_decode_tokens_per_s": med(b_runs, "decode_tokens_per_s"),
               "B_flush_s": med(b_runs, "flush_s"), "B_bytes_written": b_runs[-1]["disk"]["kv_disk_bytes_written"]},
        "runs": {"A": a_runs, "B": b_runs, "warm": warm, "cold": cold, "ram_warm": ram},
    }
    name = (args.model or "smollm2").removesuffix(".gguf").rsplit("/", 1)[-1].lower()
    from wallbreaker.measure.reporting import write_json
    path = write_json(args.json or RESULTS / f"prefix_disk_{name}.json", result)
    ab = result["ab"]
    print(f"{describe_machine(facts)}\n"
          f"{result['model']}, {args.dtype}: cold {cold['ttft_s']:.2f} s, warm from disk {warm['ttft_s']:.3f} s "
          f"({result['speedup']:.1f}x; {warm['cached_prompt_tokens']} of {warm['prompt_tokens']} prompt tokens read), "
          f"same greedy tokens as cold: {result['same_greedy_tokens']} (first difference at "
          f"{result['first_differing_token']}; top-5 log-probabilities of every step equal: "
          f"{result['same_top_logprobs']}), as warm from RAM ({ram['ttft_s']:.3f} s): "
          f"{result['same_greedy_tokens_as_ram_warm']}\n"
          f"A/B cold prompt: TTFT {ab['A_disk_off_ttft_s']:.2f} / {ab['B_disk_on_ttft_s']:.2f} s, decode "
          f"{ab['A_disk_off_decode_tokens_per_s']:.1f} / {ab['B_disk_on_decode_tokens_per_s']:.1f} tokens/s "
          f"(disk off / on); {path}")


if __name__ == "__main__":
    main()
