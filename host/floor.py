#!/usr/bin/env python3
"""The floor: how fast can a star allreduce through one Python aggregator process be on this machine?

`zerosum bench --floor` runs it in the same run as ZeroSum and gloo (`run_floor`); it is also a script.

An idealised ZeroSum data path, no loss recovery, no block headers: W worker processes quantise a float32
tensor to int32 (numba), cut the non-zero 256-value blocks into datagrams of up to 16,000 values with an
8-byte header (chunk index, count), and keep `window` datagrams in flight; one aggregator process adds
each datagram into a slot (chunk mod slots) with numpy and, when all W have arrived, sends the sum to
every worker; workers dequantise into the output.  Dense: every block non-zero.  Sparse (density d): the
same random blocks on every rank (the best case for block sparsity; union = d).
Same run, same processes: torch gloo allreduce of the same tensor.  Prints seconds and ratio per density.
This is the floor estimate behind the fast-path targets, not a product: run it to see whether a target
is physically reachable here.

    python limit_star.py [--world 4] [--size 26214400] [--densities 1.0,0.1,0.01] [--iters 3]
"""
import argparse, os, socket, struct, time
import multiprocessing as mp
import numpy as np

VALS = 16000                    # int32 values per datagram (64,000 B payload)
HDR = struct.Struct("<II")      # chunk index, number of values


def free_port(kind=socket.SOCK_DGRAM):
    s = socket.socket(socket.AF_INET, kind); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def bufs(s, n):
    # SO_RCVBUFFORCE / SO_SNDBUFFORCE (root) pass net.core.rmem_max; fall back to the capped size
    for force, plain in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):
        try:
            s.setsockopt(socket.SOL_SOCKET, force, n)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, plain, n)


def aggregator(port, world, noadd, slots, ready):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bufs(s, 64 << 20)
    s.bind(("127.0.0.1", port))
    ready.set()
    buf = bytearray(HDR.size + 4 * VALS)
    acc = np.zeros((slots, VALS), np.int32)
    cnt = np.zeros(slots, np.int64)
    out = bytearray(HDR.size + 4 * VALS)
    outv = np.frombuffer(out, np.int32, offset=HDR.size)
    addrs = {}
    while True:
        n, a = s.recvfrom_into(buf)
        if n == 1:   # join: worker rank in one byte
            addrs[buf[0]] = a
            continue
        c, k = HDR.unpack_from(buf)
        sl = c % slots
        if not noadd:
            v = np.frombuffer(buf, np.int32, k, HDR.size)
            if cnt[sl] == 0:
                acc[sl, :k] = v
            else:
                acc[sl, :k] += v
        cnt[sl] += 1
        if cnt[sl] == world:
            HDR.pack_into(out, 0, c, k)
            if not noadd:
                outv[:k] = acc[sl, :k]
            m = HDR.size + 4 * k
            for r in range(world):
                s.sendto(memoryview(out)[:m], addrs[r])
            cnt[sl] = 0


def worker(rank, world, port, gport, size, densities, iters, window, q, sockets_only=False):
    import torch, torch.distributed as dist
    from numba import njit

    @njit(cache=False, nogil=True)
    def quantise(x, scale, out):
        for i in range(x.size):
            out[i] = np.int32(np.rint(x[i] * scale))

    @njit(cache=False, nogil=True)
    def dequantise(q, inv, out):
        for i in range(q.size):
            out[i] = q[i] * inv

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gport))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bufs(s, 32 << 20)
    s.bind(("127.0.0.1", 0))
    agg = ("127.0.0.1", port)
    s.sendto(bytes([rank]), agg)
    dist.barrier(); time.sleep(0.2); dist.barrier()
    res = {}
    size = -(-size // 256) * 256               # whole blocks: a last partial one is moved whole
    for d in densities:
        rng = np.random.default_rng(7)          # same blocks on every rank
        nb = size // 256
        x = np.zeros(size, np.float32)
        idx = np.flatnonzero(rng.random(nb) < d) if d < 1 else np.arange(nb)
        xv = x.reshape(-1, 256)
        xv[idx] = np.random.default_rng(rank).standard_normal((len(idx), 256)).astype(np.float32)
        t = torch.from_numpy(x.copy())
        qbuf = np.zeros(size, np.int32)
        y = np.zeros(size, np.float32)
        sbuf = bytearray(HDR.size + 4 * VALS)
        sview = np.frombuffer(sbuf, np.int32, offset=HDR.size)
        rbuf = bytearray(HDR.size + 4 * VALS)
        rview = np.frombuffer(rbuf, np.int32, offset=HDR.size)
        scale = float(2 ** 20); inv = 1.0 / scale
        quantise(x[:256], scale, qbuf[:256]); dequantise(qbuf[:256], inv, y[:256])
        tz, tg, cz = [], [], []
        ysum_buf = np.zeros(size, np.float32)
        for it in range(iters + 1):
            t.copy_(torch.from_numpy(x)); dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(t); dist.barrier(); tg.append(time.perf_counter() - t0)
            dist.barrier(); t0 = time.perf_counter(); c0 = time.process_time()
            if sockets_only:
                nz = idx; qg = qbuf[:len(idx) * 256]; gathered = qg
            else:
                # scan: which 256-blocks are non-zero (the real runtime must do this too)
                nz = np.flatnonzero(np.any(xv != 0, axis=1))
                y[:] = 0
                gathered = xv[nz].reshape(-1)                  # non-zero blocks, contiguous
                qg = qbuf[:gathered.size]
                quantise(gathered, scale, qg)
            nchunks = (qg.size + VALS - 1) // VALS
            sent = recvd = 0
            ysum = ysum_buf[:gathered.size]
            while recvd < nchunks:
                while sent < nchunks and sent - recvd < window:
                    lo = sent * VALS; k = min(VALS, qg.size - lo)
                    HDR.pack_into(sbuf, 0, sent, k); sview[:k] = qg[lo:lo + k]
                    s.sendto(memoryview(sbuf)[:HDR.size + 4 * k], agg); sent += 1
                s.recv_into(rbuf)
                c, k = HDR.unpack_from(rbuf)
                if not sockets_only:
                    dequantise(rview[:k], inv, ysum[c * VALS:c * VALS + k])
                recvd += 1
            if not sockets_only:
                y.reshape(-1, 256)[nz] = ysum.reshape(-1, 256)
            cz.append(time.process_time() - c0); dist.barrier(); tz.append(time.perf_counter() - t0)
        err = float(np.abs(y - t.numpy()).max())
        res[d] = (float(np.median(tz[1:])), float(np.median(tg[1:])), err, float(np.median(cz[1:])))
    q.put((rank, res))
    dist.destroy_process_group()


def run_floor(world: int, size: int, densities, iters: int = 3, window: int = 64, sockets_only: bool = True) -> dict:
    """{density: (star seconds, gloo seconds)}: the star's median time and gloo's in the same processes."""
    ctx = mp.get_context("spawn")
    port, gport = free_port(), free_port(socket.SOCK_STREAM)
    ready = ctx.Event(); q = ctx.Queue()
    ag = ctx.Process(target=aggregator, args=(port, world, sockets_only, 2 * window, ready), daemon=True)
    ag.start(); ready.wait(10)
    ps = [ctx.Process(target=worker, args=(r, world, port, gport, size, list(densities), iters, window, q,
                                           sockets_only)) for r in range(world)]
    for p in ps: p.start()
    try:
        res = collect(ps, q)
    finally:
        for p in ps: p.join(10)
        for p in ps: p.kill()
        ag.kill()
    return {d: (max(res[r][d][0] for r in res), res[0][d][1]) for d in densities}


class ProcessDied(RuntimeError):
    """A process that was to report ended without doing so (killed, or a crash below Python)."""

    def __init__(self, rank: int, exitcode: int):
        super().__init__(f"rank {rank} died (exit code {exitcode})")
        self.rank, self.exitcode = rank, exitcode


def next_report(q, procs, waiting, timeout: float = 600):
    """The next item on the queue q that the processes `procs` report on. ProcessDied at once where one of
    the ranks `waiting` ended otherwise than cleanly (the others would wait for it in gloo or at a barrier:
    nothing else would end it); queue.Empty after `timeout` seconds of silence."""
    import queue
    quiet = 0.0
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            quiet += 1.0
            dead = [i for i in waiting if procs[i].exitcode not in (None, 0)]
            if dead:
                raise ProcessDied(dead[0], procs[dead[0]].exitcode) from None
            if quiet >= timeout:
                raise


def collect(ps, q, timeout: float = 600) -> dict:
    """{rank: result} from every worker process; a worker that died, or silence for `timeout` seconds, is
    an error at once."""
    import queue
    res = {}
    while len(res) < len(ps):
        try:
            rank, r = next_report(q, ps, [i for i in range(len(ps)) if i not in res], timeout)
        except ProcessDied as e:
            raise RuntimeError(f"the sockets-only star's {e}") from None
        except queue.Empty:
            raise RuntimeError(f"the sockets-only star's ranks were silent for {timeout:.0f} s") from None
        res[rank] = r
    return res


def read_pass(values: np.ndarray) -> int:
    """Read a contiguous float32/int32 array once at memory speed: what finding its non-zero blocks must
    read, with none of the scan's work. Returns the OR of its bits (non-zero iff any value's bits are)."""
    flat = values.reshape(-1)
    even = flat.size - flat.size % 2
    bits = int(np.bitwise_or.reduce(flat[:even].view(np.uint64))) if even else 0
    return bits | (int(flat[even:].view(np.uint32)[0]) if even < flat.size else 0)


def makespan(spans) -> float:
    """From each process's (start, end) per iteration (processes x iterations x 2, one clock): the
    median over iterations of the time from the first start to the last end. Not the slowest process's
    own time: with more processes than cores, some read after others have finished, and each of them
    alone takes only its share of the time the reads take together."""
    s = np.asarray(spans, np.float64)
    return float(np.median(s[:, :, 1].max(axis=0) - s[:, :, 0].min(axis=0)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--size", type=int, default=26_214_400)
    ap.add_argument("--densities", default="1.0,0.1,0.01")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sockets-only", action="store_true", help="move the datagrams only: no scan, quantise, add")
    a = ap.parse_args()
    dens = [float(x) for x in a.densities.split(",")]
    ctx = mp.get_context("spawn")
    port, gport = free_port(), free_port(socket.SOCK_STREAM)
    ready = ctx.Event(); q = ctx.Queue()
    ag = ctx.Process(target=aggregator, args=(port, a.world, a.sockets_only, 2 * a.window, ready), daemon=True)
    ag.start(); ready.wait(10)
    ps = [ctx.Process(target=worker, args=(r, a.world, port, gport, a.size, dens, a.iters, a.window, q, a.sockets_only)) for r in range(a.world)]
    for p in ps: p.start()
    res = collect(ps, q)
    with open(f"/proc/{ag.pid}/stat") as f:
        st = f.read().split()
    agg_cpu = (int(st[13]) + int(st[14])) / os.sysconf("SC_CLK_TCK")
    for p in ps: p.join(10)
    ag.kill()
    for d in dens:
        z, g, e, c = res[0][d]
        wc = sum(res[r][d][3] for r in res)
        print(f"density={d} star={z:.3f}s gloo={g:.3f}s star_vs_gloo={g / z:.2f}x maxdiff={e:.2g} worker_cpu_sum={wc:.3f}s")
    print(f"aggregator CPU over the whole run ({a.iters + 1} allreduces per density): {agg_cpu:.2f}s")


if __name__ == "__main__":
    main()
