"""Worker ranks as long-lived processes of an experiment script: each runs `script --serve RANK WORLD
*extra`, takes one JSON configuration per line on stdin and answers with one line that starts with the
script's result marker; the pool (`Ranks`) sends a configuration to every rank and collects their
answers, and `serve` is the rank's side.
`where(rank)` is a command prefix for a rank's process, e.g. ["ip", "netns", "exec", NS]."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable


def serve(marker: str, rank: int, handle: Callable[[dict], dict]) -> int:
    """A rank's loop: say it is ready, then answer each configuration on stdin with handle(cfg), or
    with the error it raised (the pool fails the run with it), until a quit or the end of stdin."""
    print(marker + json.dumps({"ready": rank}), flush=True)
    for line in sys.stdin:
        cfg = json.loads(line)
        if cfg.get("quit"):
            break
        try:
            out = handle(cfg)
        except Exception as e:
            out = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
        print(marker + json.dumps(out), flush=True)
    return 0


class Ranks:
    def __init__(self, script: str, marker: str, world: int, *extra: str,
                 where: Callable[[int], list[str]] = lambda rank: []):
        self.marker = marker
        self.procs = [subprocess.Popen([*where(r), sys.executable, script, "--serve", str(r), str(world), *extra],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for r in range(world)]
        for p in self.procs:
            self._read(p)

    def _read(self, p) -> dict:
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker process ended (exit code {p.wait()})")
            if line.startswith(self.marker):
                return json.loads(line[len(self.marker):])

    def run(self, cfg: dict) -> list[dict]:
        """Every rank's answer to `cfg`; an error of any rank raises."""
        for p in self.procs:
            p.stdin.write(json.dumps(cfg) + "\n")
            p.stdin.flush()
        out = [self._read(p) for p in self.procs]
        bad = [o["error"] for o in out if "error" in o]
        if bad:
            raise RuntimeError("; ".join(bad))
        return out

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"quit": True}) + "\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
