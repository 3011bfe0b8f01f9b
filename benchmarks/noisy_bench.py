"""Run an mlcomp command quiet, then again while a second process spins on one core part of the time.

    python benchmarks/noisy_bench.py --start 10 --stop 40 -- mlcomp bench mlp --targets eager,cpu,onnxruntime --batch 1,32

The spinner (``while True: pass`` pinned to core 0 with ``taskset`` where there is one) starts
``--start`` seconds into the loaded run and is killed ``--stop`` seconds in, so the load comes and
goes during the measurement.  Each run's output is printed after the load average when it began;
``--loaded-only`` skips the quiet run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time


def _spinner(start_s: float, stop_s: float, done: threading.Event, log: list[str]) -> None:
    if done.wait(start_s):
        return
    cmd = [sys.executable, "-c", "while True: pass"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd)
    log.append(f"spinner pid {proc.pid} started at {start_s:g} s")
    done.wait(max(0.0, stop_s - start_s))
    proc.kill()
    proc.wait()
    log.append(f"spinner stopped at {min(stop_s, time.monotonic() - log_start[0]):.0f} s")


log_start = [0.0]


def run(command: list[str], load: tuple[float, float] | None) -> int:
    print(f"$ {' '.join(command)}   [{'load ' + str(load) if load else 'quiet'}; load average at start "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores]", flush=True)
    done, log = threading.Event(), []
    log_start[0] = time.monotonic()
    spin = threading.Thread(target=_spinner, args=(*load, done, log)) if load else None
    if spin:
        spin.start()
    rc = subprocess.call(command)
    done.set()
    if spin:
        spin.join()
    print("\n".join(log) + f"\nload average at end {os.getloadavg()[0]:.2f}\n", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=float, default=10.0, help="seconds into the loaded run the spinner starts")
    ap.add_argument("--stop", type=float, default=60.0, help="seconds into the loaded run the spinner stops")
    ap.add_argument("--loaded-only", action="store_true")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rc = 0 if args.loaded_only else run(command, None)
    return rc or run(command, (args.start, args.stop))


if __name__ == "__main__":
    sys.exit(main())
